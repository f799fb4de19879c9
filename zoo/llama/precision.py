"""Llama's precision map: which matmul of a decoder layer runs in FP8, and in which recipe."""

from __future__ import annotations

from dataclasses import dataclass

from zoo.layers.precision import PrecisionMap, Recipe


@dataclass(frozen=True)
class LlamaPrecision(PrecisionMap, model="zoo.llama.model.Llama"):
    """Recipe of every projection of a Llama decoder layer (``zoo/llama/model.py``), named by its
    output's placement name: ``query``/``key``/``value`` ([B S D] @ [D H K]), ``attn_out`` (the
    output projection), ``mlp_gate``/``mlp_up`` and ``mlp_down`` (SwiGLU). Attention itself, norms,
    the embedding and the head stay in the model's dtype."""

    query: Recipe = "none"
    key: Recipe = "none"
    value: Recipe = "none"
    attn_out: Recipe = "none"
    mlp_gate: Recipe = "none"
    mlp_up: Recipe = "none"
    mlp_down: Recipe = "none"
