"""QLoRA's frozen base in int8, row-wise absmax, as bitsandbytes' LLM.int8 stores a linear
weight (``Linear8bitLt``, no outlier threshold) (:mod:`zoo.lora.quantized`: dequantized a
layer at a time inside the layer scan).

Each row of a stored ``[out, in]`` matrix is scaled by ``127 / absmax`` of the row (float32)
and rounded half to even into int8; the row's absmax is kept as float32 (``stats``).
Dequantizing: ``codes * stats * (1 / 127)`` in float32, bit for bit what
``bitsandbytes.functional.int8_vectorwise_dequant`` returns for what
``int8_vectorwise_quant`` made (``tests/test_qlora.py``, ``tests/fixtures/int8``). Half of
bfloat16's bytes, a quarter of float32's.

Dimension letters: ``S`` the weight's stacked axes (layers, experts), ``o`` / ``i`` the stored
matrix's out and in features.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float32, Int8

from zoo.core.protocol import CausalLM
from zoo.lora.quantized import QuantizedWeight, dequantized, load_quantized, nbytes, quantize_stacks

__all__ = ["INV_127", "Int8Weight", "dequantize", "dequantized", "from_pretrained", "nbytes", "quantize", "quantize_model"]

# bitsandbytes' 1 / 127 (a Python float there, applied to a float32 tensor: in float32)
INV_127 = np.float32(7.874015718698502e-3)


def quantize(w: np.ndarray, what: str = "weight") -> dict[str, np.ndarray]:
    """One stored ``[out, in]`` matrix: ``codes`` [out, in] (int8) and ``stats`` [out] (its
    rows' absmax, float32). A row of zeros is codes of zeros."""
    x = np.asarray(w, np.float32)
    if x.ndim != 2:
        raise ValueError(f"int8: {what} is not one [out, in] matrix: shape {x.shape}")
    stats = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = x * (np.float32(127.0) / stats)[:, None]
    codes = np.where(stats[:, None] > 0, np.rint(scaled), 0).astype(np.int8)
    return {"codes": codes, "stats": stats}


def dequantize(codes: Int8[Array, "*S o i"], stats: Float32[Array, "*S o"]) -> Float32[Array, "*S v"]:
    """The stored values (float32, row-major, stacked axes first), as bitsandbytes dequantizes them."""
    values = codes.astype(jnp.float32) * stats[..., None] * INV_127
    return values.reshape(*codes.shape[:-2], -1)


class Int8Weight(QuantizedWeight):
    """A layer stack's linear weight in row-wise int8 (one matrix per stacked index, in its
    checkpoint's ``[out, in]`` layout). Frozen: nothing in it is trained."""

    codes: Int8[Array, "*S o i"]
    stats: Float32[Array, "*S o"]
    format: ClassVar[str] = "int8"
    split: ClassVar = {"codes": (2, lambda out, _: out)}  # split by rows

    def stored_values(self) -> Float32[Array, "*S v"]:
        return dequantize(self.codes, self.stats)


def _shapes(out_in: tuple[int, int], what: str) -> dict[str, tuple[tuple[int, ...], object]]:
    return {"codes": (tuple(out_in), jnp.int8), "stats": ((out_in[0],), jnp.float32)}


def quantize_model(model: CausalLM) -> CausalLM:
    """``model`` with every linear weight of its layer stacks in row-wise int8
    (:class:`Int8Weight`): :func:`zoo.lora.quantized.quantize_stacks`."""
    return quantize_stacks(model, quantize, _shapes, Int8Weight)


def from_pretrained(path: str | Path, **options: Any) -> CausalLM:
    """A Hugging Face checkpoint with its layer stacks' linear weights in row-wise int8, quantized on
    the host as they are read (:func:`zoo.lora.quantized.load_quantized`; ``options``: those of
    :func:`zoo.from_pretrained`, one device)."""
    return load_quantized(path, quantize, _shapes, Int8Weight, **options)
