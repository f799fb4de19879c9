"""QLoRA's frozen base in NF4 with double quantization, as bitsandbytes stores it
(:mod:`zoo.lora.quantized`: dequantized a layer at a time inside the layer scan).

NF4 (QLoRA, Dettmers et al. 2023): each block of ``BLOCK`` (64) consecutive values of a stored
``[out, in]`` matrix (row-major, as ``nn.Linear`` holds it) is scaled by its absolute maximum
into [-1, 1] and each value becomes the index of the nearest of the 16 :data:`NF4` levels (ties
to the lower), two indices a byte (the first in the high nibble). Double quantization: the
blocks' float32 absmax, less their mean (``offset``), are quantized in blocks of
``STATS_BLOCK`` (256) the same way to the 256 levels of bitsandbytes' signed dynamic map
(:func:`dynamic_map`), with a float32 absmax per block of them. Dequantizing multiplies back in
float32: ``NF4[index] * (code[absmax_index] * absmax2 + offset)``, bit for bit what
``bitsandbytes.functional.dequantize_4bit`` returns (``tests/test_qlora.py`` holds both to
weights bitsandbytes quantized, ``tests/fixtures/nf4``).

Dimension letters: ``S`` the weight's stacked axes (layers, experts), ``n`` its stored values
over two (bytes), ``b`` its blocks of 64, ``c`` their blocks of 256.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float32, UInt8

from zoo.core.protocol import CausalLM
from zoo.errors import ConfigError
from zoo.lora.quantized import QuantizedWeight, dequantized, load_quantized, nbytes, quantize_stacks

__all__ = [
    "BLOCK",
    "NF4",
    "STATS_BLOCK",
    "NF4Weight",
    "dequantize",
    "dequantized",
    "dynamic_map",
    "from_pretrained",
    "nbytes",
    "quantize",
    "quantize_model",
]  # fmt: skip

BLOCK = 64  # values per absmax (bitsandbytes' blocksize for 4-bit)
STATS_BLOCK = 256  # absmax per second-level absmax (bitsandbytes' double quantization)

# The 16 NF4 levels: quantiles of a standard normal, scaled to [-1, 1], with an exact zero
# (bitsandbytes' table, float32).
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)  # fmt: skip


@functools.cache
def dynamic_map() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map(signed=True)``): 256 sorted
    float32 levels, for each exponent ``10^-6 .. 10^0`` the midpoints of ``2^i + 1`` evenly
    spaced points of [0.1, 1] (``torch.linspace`` in float32), both signs, and 0 and 1."""
    data: list[float] = []
    for i in range(7):
        n = 2**i + 1
        start, end = np.float64(np.float32(0.1)), np.float64(1.0)
        step = np.float64(np.float32((np.float32(1.0) - np.float32(0.1)) / np.float32(n - 1)))
        # torch.linspace on the CPU: from the start below the half-way point, from the end above
        # it, each point one fused multiply-add (exact in float64, then rounded once)
        pts = [np.float32(start + step * k) if k < n // 2 else np.float32(end - step * (n - 1 - k)) for k in range(n)]
        means = [np.float32((pts[k] + pts[k + 1]) / np.float32(2)) for k in range(n - 1)]
        scale = np.float32(10.0 ** (-6 + i))  # a Python scalar times a float32 tensor: in float32
        data += [float(scale * m) for m in means] + [float(-scale * m) for m in means]
    data += [0.0, 1.0]
    return np.sort(np.array(data, np.float32))


def _blockwise(x: np.ndarray, levels: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block of ``x`` scaled by ``1 / absmax`` into [-1, 1] and each value the index of the
    nearest level (the lower at a tie: bitsandbytes' ``bucketize`` on the midpoints)."""
    blocks = x.reshape(-1, block)
    absmax = np.abs(blocks).max(axis=1)
    scaled = np.clip(blocks * (np.float32(1.0) / np.maximum(absmax, np.float32(1e-38)))[:, None], -1, 1)
    bounds = (levels[:-1] + levels[1:]) / np.float32(2)
    return np.searchsorted(bounds, scaled.reshape(-1), side="left").astype(np.uint8), absmax


def quantize(w: np.ndarray, what: str = "weight") -> dict[str, np.ndarray]:
    """One stored matrix (any shape; its values in row-major order) in NF4 with double
    quantization: ``packed`` [n], ``absmax`` [b] (uint8), ``absmax2`` [c], ``offset`` [] (float32)."""
    x = np.asarray(w, np.float32).reshape(-1)
    if x.size % BLOCK or x.size == 0:
        raise ConfigError(f"NF4: {what} has {x.size} values, not a positive multiple of the block of {BLOCK}")
    q, absmax = _blockwise(x, NF4, BLOCK)
    offset = np.float32(absmax.mean(dtype=np.float64))
    stats = absmax - offset
    pad = -len(stats) % STATS_BLOCK  # the last block of absmax may be short: padded, its own maximum kept
    q2, absmax2 = _blockwise(np.concatenate([stats, np.full(pad, stats[-1], np.float32)]), dynamic_map(), STATS_BLOCK)
    return {"packed": (q[0::2] << 4) | q[1::2], "absmax": q2[: len(stats)], "absmax2": absmax2, "offset": offset}


def dequantize(packed: UInt8[Array, "*S n"], absmax: UInt8[Array, "*S b"], absmax2: Float32[Array, "*S c"],
               offset: Float32[Array, "*S"]) -> Float32[Array, "*S v"]:  # fmt: skip
    """The stored values (float32, row-major, stacked axes first), as bitsandbytes dequantizes them."""
    lead, nb = absmax.shape[:-1], absmax.shape[-1]
    code = jnp.asarray(dynamic_map())[absmax.astype(jnp.int32)]
    padded = jnp.pad(code, [(0, 0)] * len(lead) + [(0, -nb % STATS_BLOCK)])
    scales = (padded.reshape(*lead, -1, STATS_BLOCK) * absmax2[..., None]).reshape(*lead, -1)[..., :nb]
    scales = scales + offset[..., None]
    idx = jnp.stack([packed >> 4, packed & 15], axis=-1).reshape(*lead, -1).astype(jnp.int32)
    values = jnp.asarray(NF4)[idx].reshape(*lead, nb, BLOCK) * scales[..., None]
    return values.reshape(*lead, -1)


class NF4Weight(QuantizedWeight):
    """A layer stack's linear weight stored in NF4 (one quantized matrix per stacked index, in
    its checkpoint's ``[out, in]`` layout), dequantized where the layer scan reads a layer of it
    into the family's layout and ``dtype``. Frozen: nothing in it is trained."""

    packed: UInt8[Array, "*S n"]
    absmax: UInt8[Array, "*S b"]
    absmax2: Float32[Array, "*S c"]
    offset: Float32[Array, "*S"]
    format: ClassVar[str] = "nf4"
    split: ClassVar = {"packed": (1, lambda out, in_: out * in_ // 2)}  # two values a byte

    def stored_values(self) -> Float32[Array, "*S v"]:
        return dequantize(self.packed, self.absmax, self.absmax2, self.offset)


def _shapes(out_in: tuple[int, int], what: str) -> dict[str, tuple[tuple[int, ...], object]]:
    """The shapes of one ``[out, in]`` matrix's codes and scales."""
    size = math.prod(out_in)
    if size % BLOCK:
        raise ConfigError(f"NF4: {what} has {size} values a matrix, not a multiple of the block of {BLOCK}")
    n = size // BLOCK
    return {"packed": ((size // 2,), jnp.uint8), "absmax": ((n,), jnp.uint8),
            "absmax2": ((-(-n // STATS_BLOCK),), jnp.float32), "offset": ((), jnp.float32)}  # fmt: skip


def quantize_model(model: CausalLM) -> CausalLM:
    """``model`` with every linear weight of its layer stacks in NF4 (:class:`NF4Weight`):
    :func:`zoo.lora.quantized.quantize_stacks`."""
    return quantize_stacks(model, quantize, _shapes, NF4Weight)


def from_pretrained(path: str | Path, **options: Any) -> CausalLM:
    """A Hugging Face checkpoint with its layer stacks' linear weights in NF4, quantized on
    the host as they are read (:func:`zoo.lora.quantized.load_quantized`; ``options``: those of
    :func:`zoo.from_pretrained`, one device)."""
    return load_quantized(path, quantize, _shapes, NF4Weight, **options)
