"""QLoRA's frozen base: linear weights stored in NF4 with double quantization, as bitsandbytes
stores them, and dequantized a layer at a time inside the layer scan.

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

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Float32, UInt8

from zoo.core.layout import is_layer_stack
from zoo.core.params import Deferred, Param, map_params
from zoo.core.protocol import CausalLM
from zoo.core.registry import family_of
from zoo.errors import ConfigError
from zoo.lora.adapter import linear_weights

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


class NF4Weight(Deferred):
    """A layer stack's linear weight stored in NF4 (one quantized matrix per stacked index, in
    its checkpoint's ``[out, in]`` layout), dequantized where the layer scan reads a layer of it
    (:class:`zoo.core.params.Deferred`) into the family's layout and ``dtype``. Frozen: nothing
    in it is trained."""

    packed: UInt8[Array, "*S n"]
    absmax: UInt8[Array, "*S b"]
    absmax2: Float32[Array, "*S c"]
    offset: Float32[Array, "*S"]
    param: Param = eqx.field(static=True)
    sizes: tuple[tuple[str, int], ...] = eqx.field(static=True)
    dtype: str = eqx.field(static=True)

    def value(self) -> Float[Array, "*dims"]:
        """One layer's weight (the layer axis gone; any view's leading axes kept)."""
        q = jax.lax.stop_gradient(self)
        flat = dequantize(q.packed, q.absmax, q.absmax2, q.offset)
        sizes, p = dict(self.sizes), self.param
        names = p.names[1:]
        stacked = [a for a in p.stacked if a in names]
        order = stacked + [a for g in p.hf_groups() for a in g]
        lead = flat.shape[: flat.ndim - 1 - len(stacked)]
        w = flat.reshape(*lead, *(sizes[a] for a in order))
        w = w.transpose([*range(len(lead)), *(len(lead) + order.index(a) for a in names)])
        return w.astype(self.dtype)

    def field_params(self) -> dict[str, Param]:
        """Frozen, and not in checkpoints (a quantized base is made from one: :func:`quantize_model`)."""
        s = " ".join(self.param.stacked)
        letters = {"packed": "n", "absmax": "b", "absmax2": "c", "offset": ""}
        return {k: Param(axes=f"{s} {x}".strip(), hf=None, init="zeros", trainable=False) for k, x in letters.items()}


def quantize_model(model: CausalLM) -> CausalLM:
    """``model`` with every linear weight of its layer stacks (those a LoRA target may name:
    :func:`zoo.lora.linear_weights`) in NF4 (:class:`NF4Weight`); the embedding, the head, norms,
    routers and weights outside the stacks as they were. An abstract model's (its arrays
    ``jax.ShapeDtypeStruct``, as the planner holds one) gets the shapes of its codes."""
    specs = family_of(model).param_specs(model.config)
    sizes = tuple(sorted(model.config.sizes.items()))
    targets = {path for path, p in linear_weights(specs).items() if is_layer_stack(p)}

    def leaf(path: str, w):
        if path not in targets:
            return w
        p = specs[path]
        stacked_shape = w.shape[: len(p.stacked)]
        if isinstance(w, jax.ShapeDtypeStruct):
            return jax.eval_shape(lambda: _zeros(p, stacked_shape, math.prod(w.shape) // math.prod(stacked_shape),
                                                 sizes, str(w.dtype), path))  # fmt: skip
        per = [quantize(np.asarray(w[idx]).transpose(_to_hf(p)), f"{path}[{idx}]") for idx in np.ndindex(*stacked_shape)]
        arrays = {k: np.stack([q[k] for q in per]).reshape(*stacked_shape, *np.shape(per[0][k])) for k in per[0]}
        return NF4Weight(**{k: jnp.asarray(v) for k, v in arrays.items()}, param=p, sizes=sizes, dtype=str(w.dtype))

    return map_params(leaf, model)


def _zeros(p: Param, stacked: tuple[int, ...], size: int, sizes: tuple, dtype: str, path: str) -> NF4Weight:
    """An NF4 weight of zeros: ``stacked`` matrices of ``size`` values (the shapes of its codes)."""
    if size % BLOCK:
        raise ConfigError(f"NF4: {path} has {size} values a matrix, not a multiple of the block of {BLOCK}")
    n = size // BLOCK
    shapes = {"packed": (size // 2,), "absmax": (n,), "absmax2": (-(-n // STATS_BLOCK),), "offset": ()}
    arrays = {k: jnp.zeros((*stacked, *s), jnp.uint8 if k in ("packed", "absmax") else jnp.float32) for k, s in shapes.items()}
    return NF4Weight(**arrays, param=p, sizes=sizes, dtype=dtype)


def _to_hf(p: Param) -> list[int]:
    """The transposition of one stored matrix from the family's layout (stacked axes gone) to
    its checkpoint's letters' order (then reshaped: ``[out, in]``)."""
    inner = [a for a in p.names if a not in p.stacked]
    return [inner.index(a) for g in p.hf_groups() for a in g]


def is_quantized(model: object) -> bool:
    """Whether ``model`` (or an adapted model's base) holds NF4 weights."""
    return any(isinstance(x, NF4Weight) for x in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, NF4Weight)))


def dequantized(model: CausalLM) -> CausalLM:
    """``model`` with its NF4 weights dequantized (a plain model of the family)."""
    return jax.tree.map(lambda x: x.stacked_value() if isinstance(x, NF4Weight) else x, model,
                        is_leaf=lambda x: isinstance(x, NF4Weight))  # fmt: skip


def nbytes(tree: object) -> int:
    """Bytes of a tree's arrays (a quantized model's: its codes and scales)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
