"""Qwen3's precision map: which matmul of a decoder layer runs in FP8, and in which recipe."""

from __future__ import annotations

from dataclasses import dataclass

from zoo.layers.precision import PrecisionMap, Recipe


@dataclass(frozen=True)
class Qwen3Precision(PrecisionMap, model="zoo.qwen3.model.Qwen3"):
    """Recipe of every dense projection of a Qwen3 layer (``zoo/qwen3/model.py``), named by its
    output's placement name: ``q_proj``/``k_proj`` (before the per-head norms), ``value``,
    ``attn_out``, the dense layers' SwiGLU ``mlp_gate``/``mlp_up``/``mlp_down``, and the MoE
    layers' routed experts ``moe_gate``/``moe_up``/``moe_down`` (in FP8 on the ``capacity``
    expert path only: :mod:`zoo.layers.capacity_mlp`). The router stays in the model's dtype."""

    q_proj: Recipe = "none"
    k_proj: Recipe = "none"
    value: Recipe = "none"
    attn_out: Recipe = "none"
    mlp_gate: Recipe = "none"
    mlp_up: Recipe = "none"
    mlp_down: Recipe = "none"
    moe_gate: Recipe = "none"
    moe_up: Recipe = "none"
    moe_down: Recipe = "none"
