"""DeepSeek-V3's placement map: where each named tensor of its layers waits for the backward pass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from zoo.placement import Placement, PlacementMap, layer_input_slot


@dataclass(frozen=True)
class DeepseekV3Placement(PlacementMap, model="zoo.deepseek_v3.model.DeepseekV3"):
    """Placement of every named tensor of a DeepSeek-V3 layer (``zoo/deepseek_v3/layer.py``,
    ``mla.py``, ``moe.py``). One map places the dense and the MoE layers (two scans, one
    policy) and the MTP block (checkpointed with the same policy); a name absent from a layer
    kind is simply not there (``mlp_*`` in the dense layers only; ``router_logits``, ``moe_*``
    and ``shared_*`` in the MoE layers only).

    Shapes per layer (B batch, S sequence, T = B·S tokens, D width, H heads, Q/C query/kv
    latent, K query/key head size, U value head size, F dense MLP, E experts, K' = top-k,
    M expert hidden, X shared experts' hidden, N' rows of the expert tiles):

    - ``layer_input`` [B S D]: the residual stream entering the layer (no ``remat``).
    - ``attn_norm`` [B S D]: RMSNorm before attention, input of the q and kv down projections.
    - ``q_a`` [B S Q]: query down projection before its RMSNorm (whose backward needs it).
    - ``q_latent`` [B S Q]: the normalised query latent, input of the query up projection.
      (``q_a`` and ``q_latent`` exist only with ``q_lora_rank``; a plain ``wq`` has neither.)
    - ``kv_a`` [B S C]: the latent part of the kv down projection before its RMSNorm.
    - ``kv_latent`` [B S C]: the normalised kv latent, input of the kv up projection.
    - ``query`` [B S H K] (rope part rotated), ``key`` [B S H K] (the shared rope key
      broadcast to every head), ``value`` [B S H U].
    - ``context`` [B S H U]: attention output, input of the output projection.
    - ``attn_lse`` [B H S] float32: each query's log-sum-exp over its keys; with the output, what
      the backward pass of blockwise attention needs (``zoo.layers.attention``).
    - ``attn_out`` [B S D]: output projection; the residual add's result feeds the MLP norm.
    - ``mlp_norm`` [B S D]: RMSNorm before the MLP or MoE.
    - ``mlp_gate``, ``mlp_up``, ``mlp_hidden`` [B S F]: the dense layers' SwiGLU.
    - ``router_logits`` [T E] (float32): router scores before the sigmoid.
    - ``moe_gate``, ``moe_up``, ``moe_hidden``: the routed experts' SwiGLU, on the sorted
      (token, expert) rows: [T·K' M] for ``grouped`` and ``ragged_dot`` (under expert
      parallelism, the received buffer), [N' tile M] for ``tiled``, [T E M] for ``dense``.
    - ``moe_out`` [T K' D]: each routed expert's output before the weighted combine, whose
      gradient (for the routing weights) needs it. The ``dense`` reference path folds the
      weights in before its down projection and has no such tensor.
    - ``shared_gate``, ``shared_up``, ``shared_hidden`` [B S X]: the shared experts' SwiGLU.

    The output projections of the SwiGLUs (dense, shared, and the ``dense`` path's routed
    experts) are not named: they only feed adds, and the backward pass never needs them.
    """

    presets: ClassVar[Mapping[str, str]] = {
        # Keep every matmul output; recompute the norms and the SwiGLU products.
        "save_matmuls": "remat+q_a=device,kv_a=device,query=device,key=device,value=device,context=device,attn_lse=device,"
        "attn_out=device,mlp_gate=device,mlp_up=device,router_logits=device,moe_gate=device,moe_up=device,"
        "moe_out=device,shared_gate=device,shared_up=device",
        # NVIDIA's DeepSeek-V3 host-offloading policy: the MLA query and key/value projection
        # intermediates and the MoE up-projection intermediates in pinned host memory, the rest
        # recomputed. The projection intermediates include the pre-norm latents q_a and kv_a:
        # left to remat, the backward would recompute both down projections to get their
        # RMSNorm inputs, and offloading q_latent / kv_latent would spare only the norms. The
        # "up-projection" is the experts' first GEMM (Megatron's expert fc1), which computes
        # gate and up together for SwiGLU, so moe_gate goes to host with moe_up.
        "nvidia_offload": "remat+q_a=pinned_host,q_latent=pinned_host,kv_a=pinned_host,kv_latent=pinned_host,"
        "query=pinned_host,key=pinned_host,value=pinned_host,moe_gate=pinned_host,moe_up=pinned_host",
        # NVIDIA's MaxText DeepSeek-V3 671B run on 128 GB200 (908 TFLOP/s per GPU, 578 under
        # remat): MaxText's custom remat policy offloading query_proj, value_proj and the routed
        # experts' first GEMM (mlpwi_0, mlpwi_1: zoo's moe_gate, moe_up), the rest recomputed.
        "maxtext_offload": "remat+query=pinned_host,value=pinned_host,moe_gate=pinned_host,moe_up=pinned_host",
    }

    layer_input: Placement = layer_input_slot()
    attn_norm: Placement = "device"
    q_a: Placement = "device"
    q_latent: Placement = "device"
    kv_a: Placement = "device"
    kv_latent: Placement = "device"
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
    shared_gate: Placement = "device"
    shared_up: Placement = "device"
    shared_hidden: Placement = "device"
