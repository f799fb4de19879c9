"""QLoRA's frozen base in FP8 (E4M3) with a float32 scale per tile, as DeepSeek-V3's checkpoint
stores its linear weights (:mod:`zoo.lora.quantized`: dequantized a layer at a time inside the
layer scan).

Each stored ``[out, in]`` matrix is cut into tiles of ``block`` (``quantization_config.
weight_block_size``; 128 x 128 in DeepSeek-V3's, partial at the edges); a tile's values are
divided by its scale ``absmax / 448`` (448: E4M3's largest finite value) and cast to E4M3,
rounding to nearest even, and the scale is kept as ``weight_scale_inv`` (float32). Dequantizing:
``codes * scale_inv`` per tile in float32, what ``zoo.from_pretrained`` (and DeepSeek's
``weight_dequant``) computes from such a checkpoint. :func:`from_pretrained` keeps an FP8
checkpoint's own codes and scales (DeepSeek-V3 671B's base in its published 1 byte a weight, not
re-quantized) and quantizes the weights another checkpoint stores in floating point. A byte a
weight plus a scale per tile: half of bfloat16's bytes.

Dimension letters: ``S`` the weight's stacked axes (layers, experts), ``o`` / ``i`` the stored
matrix's out and in features, ``p`` / ``q`` its tiles along them.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import equinox as eqx
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, Float, Float32

from zoo.core.params import Param
from zoo.core.protocol import CausalLM
from zoo.errors import CheckpointError
from zoo.hf.hub import resolve
from zoo.hf.load import from_pretrained as load_checkpoint
from zoo.hf.safetensors import CheckpointFiles
from zoo.lora.quantized import QuantizedWeight, dequantized, nbytes, quantize_stack, quantize_stacks, quantized_here

__all__ = ["BLOCK", "E4M3_MAX", "KEEP", "FP8Weight", "dequantize", "dequantized", "from_pretrained", "nbytes", "quantize",
           "quantize_model"]  # fmt: skip

BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size
# What DeepSeek-V3's FP8 checkpoint keeps in floating point among the layers' linear weights: the
# MoE routers (``mlp.gate``), whose scores pick the experts.
KEEP = ("gate",)
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def quantize(w: np.ndarray, what: str = "weight", block: tuple[int, int] = BLOCK) -> dict[str, np.ndarray]:
    """One stored ``[out, in]`` matrix: ``codes`` [out, in] (E4M3) and ``scale_inv`` [out
    tiles, in tiles] (float32, ``absmax / 448`` per tile; a tile of zeros: scale 0, codes 0)."""
    x = np.asarray(w, np.float32)
    if x.ndim != 2:
        raise ValueError(f"fp8: {what} is not one [out, in] matrix: shape {x.shape}")
    (o, i), (bo, bi) = x.shape, block
    p, q = -(-o // bo), -(-i // bi)
    tiles = np.pad(np.abs(x), [(0, p * bo - o), (0, q * bi - i)]).reshape(p, bo, q, bi)
    scale = (tiles.max(axis=(1, 3)) / np.float32(E4M3_MAX)).astype(np.float32)
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:o, :i]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(full > 0, x / full, 0).astype(ml_dtypes.float8_e4m3fn)
    return {"codes": codes, "scale_inv": scale}


def dequantize(codes: Float[Array, "*S o i"], scale_inv: Float32[Array, "*S p q"], block: tuple[int, int] = BLOCK
               ) -> Float32[Array, "*S v"]:  # fmt: skip
    """The stored values (float32, row-major, stacked axes first): ``codes * scale_inv`` per tile."""
    o, i = codes.shape[-2:]
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block[0], axis=-2), block[1], axis=-1)
    values = codes.astype(jnp.float32) * scale[..., :o, :i]
    return values.reshape(*codes.shape[:-2], -1)


class FP8Weight(QuantizedWeight):
    """A layer stack's linear weight in E4M3 with a float32 scale per ``block`` tile (one matrix
    per stacked index, in its checkpoint's ``[out, in]`` layout). Frozen: nothing in it is trained."""

    codes: Float[Array, "*S o i"]
    scale_inv: Float32[Array, "*S p q"]
    block: tuple[int, int] = eqx.field(static=True, default=BLOCK)
    format: ClassVar[str] = "fp8"
    split: ClassVar = {"codes": (2, lambda out, _: out)}  # split by rows

    def stored_values(self) -> Float32[Array, "*S v"]:
        return dequantize(self.codes, self.scale_inv, self.block)


def _shapes(block: tuple[int, int], out_in: tuple[int, int], what: str) -> dict[str, tuple[tuple[int, ...], object]]:
    (o, i), (bo, bi) = out_in, block
    return {"codes": ((o, i), jnp.float8_e4m3fn), "scale_inv": ((-(-o // bo), -(-i // bi)), jnp.float32)}


def quantize_model(model: CausalLM, block: tuple[int, int] = BLOCK) -> CausalLM:
    """``model`` with every linear weight of its layer stacks but the routers in E4M3 with a
    scale per ``block`` tile (:class:`FP8Weight`), as DeepSeek-V3's checkpoint holds them:
    :func:`zoo.lora.quantized.quantize_stacks`."""
    return quantize_stacks(model, functools.partial(quantize, block=block), functools.partial(_shapes, block),
                           functools.partial(FP8Weight, block=block), keep=KEEP)  # fmt: skip


def from_pretrained(path: str | Path, **options: Any) -> CausalLM:
    """A Hugging Face checkpoint with its layer stacks' linear weights as :class:`FP8Weight`
    (``options``: those of :func:`zoo.from_pretrained`, one device): a weight the checkpoint
    stores in FP8 keeps its stored codes and ``weight_scale_inv`` as they are (its tiles the
    config's ``weight_block_size``), and what an FP8 checkpoint stores otherwise stays so
    (DeepSeek-V3's routers, in float32); a checkpoint without FP8 weights has them (but the
    routers, :data:`KEEP`) quantized on the host as they are read, in 128 x 128 tiles. The device never holds them unquantized."""
    directory = resolve(Path(path))
    files = CheckpointFiles(directory)
    block, fp8_checkpoint = _block_of(directory)

    def convert(name: str, p: Param, sizes: Mapping[str, int], host: np.ndarray) -> FP8Weight | None:
        if not quantized_here(name, p, KEEP):
            return None
        keys = list(p.hf_keys(sizes))
        stored = {files.dtype_name(key) for _, key in keys}
        if stored != {"F8_E4M3"}:
            if any(s.startswith("F8_") for s in stored):
                raise CheckpointError(f"{directory}: {name}'s tensors are stored as {sorted(stored)}: all E4M3 or none")
            if fp8_checkpoint:  # kept as the checkpoint keeps it
                return None
            return quantize_stack(name, p, tuple(sorted(sizes.items())), host, functools.partial(quantize, block=block),
                                  functools.partial(_shapes, block), functools.partial(FP8Weight, block=block))  # fmt: skip
        stacked = host.shape[: len(p.stacked)]
        tiles = files.shape(f"{keys[0][1]}_scale_inv")
        codes = np.empty((*stacked, *p.hf_shape(sizes)), ml_dtypes.float8_e4m3fn)
        scales = np.empty((*stacked, *tiles), np.float32)
        for idx, key in keys:  # (their shapes checked by the load that made `host`)
            codes[idx], scales[idx] = files.get(key), files.get(f"{key}_scale_inv")
        return FP8Weight(codes=jnp.asarray(codes), scale_inv=jnp.asarray(scales), param=p,
                         sizes=tuple(sorted(sizes.items())), dtype=str(host.dtype), block=block)  # fmt: skip

    return load_checkpoint(directory, convert=convert, **options)


def _block_of(directory: Path) -> tuple[tuple[int, int], bool]:
    """The checkpoint's ``quantization_config.weight_block_size`` (:data:`BLOCK` without one),
    and whether it has one (an FP8 checkpoint; ``zoo.from_pretrained`` checks the config and
    each scale's shape as it reads them)."""
    config = json.loads((directory / "config.json").read_text())
    quantization = config.get("quantization_config") or {}
    block = quantization.get("weight_block_size") or BLOCK
    return ((int(block[0]), int(block[1])) if len(block) == 2 and math.prod(block) > 0 else BLOCK), bool(quantization)
