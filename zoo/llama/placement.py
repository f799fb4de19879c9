"""Llama's placement map: where each named tensor of a decoder layer waits for the backward pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from zoo.placement import Placement, PlacementMap, layer_input_slot


@dataclass(frozen=True)
class LlamaPlacement(PlacementMap, model="zoo.llama.model.Llama"):
    """Placement of every named tensor of a Llama decoder layer (``zoo/llama/model.py``).

    Shapes per layer (B batch, S sequence, D width, H/G query/KV heads, K head size, F MLP):

    - ``layer_input`` [B S D]: the residual stream entering the layer (no ``remat``).
    - ``attn_norm`` [B S D]: RMSNorm before attention, input of the q/k/v projections.
    - ``query`` [B S H K], ``key`` [B S G K] (after RoPE), ``value`` [B S G K].
    - ``context`` [B S H K]: attention output, input of the output projection.
    - ``attn_lse`` [B H S] float32: each query's log-sum-exp over its keys; with the output, what
      the backward pass of blockwise attention needs (``zoo.layers.attention``).
    - ``attn_out`` [B S D]: output projection; the residual add's result feeds the MLP norm.
    - ``mlp_norm`` [B S D]: RMSNorm before the MLP.
    - ``mlp_gate``, ``mlp_up`` [B S F]: the two SwiGLU input projections.
    - ``mlp_hidden`` [B S F]: ``silu(gate) * up``, input of the down projection.

    The down projection's output is not named: it only feeds the residual add that ends the
    layer, and the backward pass never needs it.
    """

    presets: ClassVar[Mapping[str, str]] = {
        # Keep every matmul output (attention's context included); recompute norms and SwiGLU.
        "save_matmuls": "remat+query=device,key=device,value=device,context=device,attn_lse=device,attn_out=device,"
        "mlp_gate=device,mlp_up=device",
        # save_matmuls, with the layer input and the q/k/v projections in pinned host memory.
        "offload_attn": "save_matmuls+layer_input=pinned_host,query=pinned_host,key=pinned_host,value=pinned_host",
    }

    layer_input: Placement = layer_input_slot()
    attn_norm: Placement = "device"
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
