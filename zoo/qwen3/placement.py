"""Qwen3's placement map: where each named tensor of its layers waits for the backward pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from zoo.placement import Placement, PlacementMap, layer_input_slot


@dataclass(frozen=True)
class Qwen3Placement(PlacementMap, model="zoo.qwen3.model.Qwen3"):
    """Placement of every named tensor of a Qwen3 / Qwen3-MoE layer (``zoo/qwen3/model.py``,
    ``zoo/layers/moe.py``). One map places the dense and the MoE layers; a name absent from a
    layer kind is simply not there (``mlp_*`` in dense layers only, ``router_logits`` and
    ``moe_*`` in MoE layers only).

    Shapes per layer (B batch, S sequence, T = B·S tokens, D width, H/G query/KV heads, K head
    size, F dense MLP, E experts, K' top-k, M expert hidden):

    - ``layer_input`` [B S D]: the residual stream entering the layer (no ``remat``).
    - ``attn_norm`` [B S D]: RMSNorm before attention, input of the q/k/v projections.
    - ``q_proj`` [B S H K], ``k_proj`` [B S G K]: the query and key projections before their
      per-head RMSNorm (whose backward needs them).
    - ``query`` [B S H K], ``key`` [B S G K] (normed, after RoPE), ``value`` [B S G K].
    - ``context`` [B S H K]: attention output, input of the output projection.
    - ``attn_lse`` [B H S] float32: each query's log-sum-exp over its keys; with the output, what
      the backward pass of blockwise attention needs (``zoo.layers.attention``).
    - ``attn_out`` [B S D]: output projection; the residual add's result feeds the MLP norm.
    - ``mlp_norm`` [B S D]: RMSNorm before the MLP or MoE.
    - ``mlp_gate``, ``mlp_up``, ``mlp_hidden`` [B S F]: the dense layers' SwiGLU.
    - ``router_logits`` [T E] (float32): router scores before the softmax.
    - ``moe_gate``, ``moe_up``, ``moe_hidden``: the routed experts' SwiGLU on the sorted
      (token, expert) rows ([T·K' M] for ``grouped`` and ``ragged_dot``; see DeepSeek-V3's map
      for the other expert paths).
    - ``moe_out`` [T K' D]: each routed expert's output before the weighted combine.
    """

    presets: ClassVar[Mapping[str, str]] = {
        # Keep every matmul output; recompute the norms, RoPE and the SwiGLU products.
        "save_matmuls": "remat+q_proj=device,k_proj=device,value=device,context=device,attn_lse=device,attn_out=device,"
        "mlp_gate=device,mlp_up=device,router_logits=device,moe_gate=device,moe_up=device,moe_out=device",
        # poolside's Qwen3-30B-A3B recipe: the MLP activations in pinned host memory, the rest
        # as save_matmuls.
        "offload_mlp": "save_matmuls+mlp_gate=pinned_host,mlp_up=pinned_host,moe_gate=pinned_host,moe_up=pinned_host",
    }

    layer_input: Placement = layer_input_slot()
    attn_norm: Placement = "device"
    q_proj: Placement = "device"
    k_proj: Placement = "device"
    query: Placement = "device"
    key: Placement = "device"
    value: Placement = "device"
    context: Placement = "device"
    attn_lse: Placement = "device"
    attn_out: Placement = "device"
    mlp_norm: Placement = "device"
    mlp_gate: Placement = "device"
    mlp_up: Placement = "device"
    mlp_hidden: Placement = "device"
    router_logits: Placement = "device"
    moe_gate: Placement = "device"
    moe_up: Placement = "device"
    moe_hidden: Placement = "device"
    moe_out: Placement = "device"
