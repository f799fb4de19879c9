"""DeepSeek-V3's decoder layers: pre-norm MLA (:mod:`zoo.deepseek_v3.mla`), then a pre-norm
SwiGLU (the first ``first_k_dense_replace`` layers) or the mixture of routed and shared experts
(:mod:`zoo.deepseek_v3.moe`), each added to the residual stream. Each layer is split after its
attention (``*_ffn``), where generation joins its own attention (``decode.py``).

Dimension letters as in ``model.py``: B batch · S sequence · D model width · E routed experts.
"""

from __future__ import annotations

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int

from zoo.core.named import named
from zoo.deepseek_v3.config import DeepseekV3Config
from zoo.deepseek_v3.mla import MLA, mla
from zoo.deepseek_v3.moe import MoE, route, sequence_balance_loss
from zoo.layers import rms_norm, swiglu
from zoo.layers.decoder import DenseBlock, MoEBlock
from zoo.layers.moe import expert_load, moe_experts
from zoo.layers.moe_dispatch import dispatch_of


class DenseLayer(DenseBlock):
    attn: MLA


class MoELayer(MoEBlock):
    attn: MLA
    moe: MoE


def moe_ffn(
    config: DeepseekV3Config, p: MoE, h: Float[Array, "B S D"], impl: str
) -> tuple[Float[Array, "B S D"], Int[Array, " E"], Float[Array, ""], Int[Array, ""]]:
    """Routed + shared experts. Returns the output, the per-expert load, the (un-weighted)
    sequence-wise balance loss and the (token, expert) pairs the dispatch dropped."""
    b, s, d = h.shape
    x = h.reshape(b * s, d)
    routing = route(
        x, p.router, p.router_bias, top_k=config.num_experts_per_tok, n_group=config.n_group,
        topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob, scaling=config.routed_scaling_factor,
    )  # fmt: skip
    out, dropped = moe_experts(x, routing, p.w_gate, p.w_up, p.w_down, impl=impl, dispatch=dispatch_of(config))
    out = out.reshape(b, s, d)
    if p.shared is not None:
        out = out + swiglu(h, p.shared.w_gate, p.shared.w_up, p.shared.w_down, prefix="shared")
    k = config.num_experts_per_tok
    balance = sequence_balance_loss(routing.scores.reshape(b, s, -1), routing.experts.reshape(b, s, k))
    return out, expert_load(routing.experts, config.n_routed_experts), balance, dropped


def dense_layer(config, layer: DenseLayer, x, cos, sin, segment_ids):
    """Pre-norm MLA then pre-norm SwiGLU, each added to the residual stream."""
    x = named("layer_input", lambda: x)
    h = named("attn_norm", rms_norm, x, layer.attn_norm, config.rms_norm_eps)
    x = x + mla(config, layer.attn, h, cos, sin, segment_ids)  # mla names "attn_out"
    return dense_layer_ffn(config, layer, x)


def dense_layer_ffn(config: DeepseekV3Config, layer: DenseLayer, x: Float[Array, "B S D"]) -> Float[Array, "B S D"]:
    """A dense layer after its attention: pre-norm SwiGLU added to the residual stream."""
    h = named("mlp_norm", rms_norm, x, layer.mlp_norm, config.rms_norm_eps)
    return x + swiglu(h, layer.mlp.w_gate, layer.mlp.w_up, layer.mlp.w_down)


def moe_layer(config, layer: MoELayer, x, cos, sin, segment_ids, impl):
    """Pre-norm MLA then pre-norm MoE; also the layer's expert load, balance loss and dropped pairs."""
    x = named("layer_input", lambda: x)
    h = named("attn_norm", rms_norm, x, layer.attn_norm, config.rms_norm_eps)
    x = x + mla(config, layer.attn, h, cos, sin, segment_ids)
    return moe_layer_ffn(config, layer, x, impl)


def moe_layer_ffn(
    config: DeepseekV3Config, layer: MoELayer, x: Float[Array, "B S D"], impl: str
) -> tuple[Float[Array, "B S D"], Int[Array, " E"], Float[Array, ""], Int[Array, ""]]:
    """An MoE layer after its attention: pre-norm MoE added to the residual stream; also the
    layer's expert load, balance loss and dropped pairs."""
    h = named("mlp_norm", rms_norm, x, layer.mlp_norm, config.rms_norm_eps)
    out, load, balance, dropped = moe_ffn(config, layer.moe, h, impl)
    return x + out, load, balance, dropped


def cast_moe(layer: MoELayer, dtype) -> MoELayer:
    """Compute-dtype copy of a layer's weights; the router stays float32 (it routes)."""
    router = (layer.moe.router, layer.moe.router_bias)
    layer = jax.tree.map(lambda w: w.astype(dtype), layer)
    return eqx.tree_at(lambda l: (l.moe.router, l.moe.router_bias), layer, router)
