"""DeepSeek-V3's Multi-head Latent Attention: queries through an optional low-rank path, keys
and values expanded per head from one normalised latent, RoPE on a decoupled part shared by all
heads for keys. The projections are split where generation needs them (:func:`mla_project`:
what a compressed cache keeps; :func:`mla_expand`: per-head keys and values from it).

Dimension letters as in ``model.py``: B batch · S sequence · D model width · H heads ·
Q query latent · C key/value latent · A = C + P · K query/key head size (N + P) · N its no-rope
part · P its rope part · U value head size · W = N + U · R rotary frequencies (P / 2).
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo.core.named import named
from zoo.deepseek_v3.config import DeepseekV3Config
from zoo.hooks.step import tensor_psum
from zoo.layers import apply_rope, causal_attention, rms_norm
from zoo.layers.fp8 import matmul


class MLA(eqx.Module):
    """Multi-head Latent Attention projections. With ``q_lora_rank`` the query goes through
    ``wq_a`` → RMSNorm → ``wq_b``; without, through ``wq``."""

    wq: Float[Array, "*L D H K"] | None
    wq_a: Float[Array, "*L D Q"] | None
    q_norm: Float[Array, "*L Q"] | None
    wq_b: Float[Array, "*L Q H K"] | None
    wkv_a: Float[Array, "*L D A"]
    kv_norm: Float[Array, "*L C"]
    wkv_b: Float[Array, "*L C H W"]
    wo: Float[Array, "*L H U D"]


def mla(config: DeepseekV3Config, p: MLA, h: Float[Array, "B S D"], cos: Float[Array, "B S R"], sin: Float[Array, "B S R"],
        segment_ids: Int[Array, "B S"] | None) -> Float[Array, "B S D"]:  # fmt: skip
    """Queries from the (optionally low-rank) query path; keys and values expanded from the
    normalised kv latent; RoPE on the decoupled rope part only, shared by all heads for keys."""
    q, kv_latent, k_rope = mla_project(config, p, h, cos, sin)
    k, v = mla_expand(config, p, kv_latent, k_rope)
    ctx = causal_attention(q, k, v, scale=config.softmax_scale, segment_ids=segment_ids, implementation=config.attention)
    # The projection only feeds the residual add, but the add's result feeds the MLP norm.
    return named("attn_out", lambda: tensor_psum(matmul("attn_out", "bshu,hud->bsd", ctx, p.wo)))


def mla_project(config: DeepseekV3Config, p: MLA, h: Float[Array, "B S D"], cos: Float[Array, "B S R"],
                sin: Float[Array, "B S R"]) -> tuple[Float[Array, "B S H K"], Float[Array, "B S C"], Float[Array, "B S P"]]:  # fmt: skip
    """MLA's projections: queries (RoPE on their last P), the normalised kv latent and the
    rotated rope key shared by all heads. The latent and the rope key are all that a
    compressed generation cache keeps (``zoo.generate``)."""
    eps, n, c = config.rms_norm_eps, config.qk_nope_head_dim, config.kv_lora_rank
    if p.wq is None:
        # RMSNorm's backward needs its input: naming it spares recomputing the projection.
        q_a = named("q_a", matmul, "q_a", "bsd,dq->bsq", h, p.wq_a)
        q_latent = named("q_latent", rms_norm, q_a, p.q_norm, eps)

    def query() -> Float[Array, "B S H K"]:
        if p.wq is not None:
            q = matmul("query", "bsd,dhk->bshk", h, p.wq)
        else:
            q = matmul("query", "bsq,qhk->bshk", q_latent, p.wq_b, saved="q_latent")
        q_rope = apply_rope(q[..., n:], cos, sin, interleaved=config.rope_interleave)
        return jnp.concatenate([q[..., :n], q_rope], axis=-1)

    # The down projection's columns are kv_a's and the rope key's: it runs outside both scopes.
    kv = matmul("kv_a", "bsd,da->bsa", h, p.wkv_a)
    kv_a = named("kv_a", lambda: kv[..., :c])
    kv_latent = named("kv_latent", rms_norm, kv_a, p.kv_norm, eps)
    k_rope = apply_rope(kv[..., None, c:], cos, sin, interleaved=config.rope_interleave)[..., 0, :]
    return named("query", query), kv_latent, k_rope


def mla_expand(
    config: DeepseekV3Config, p: MLA, kv_latent: Float[Array, "B T C"], k_rope: Float[Array, "B T P"]
) -> tuple[Float[Array, "B T H K"], Float[Array, "B T H U"]]:
    """Per-head keys and values from the latent through ``wkv_b`` (its first N columns per
    head make the keys' no-rope part, the last U the values); the rope key is shared."""
    n = config.qk_nope_head_dim
    # The up projection's columns are the keys' and the values': it runs outside both scopes.
    expanded = matmul("kv_b", "bsc,chw->bshw", kv_latent, p.wkv_b, saved="kv_latent")

    def key() -> Float[Array, "B T H K"]:
        k_nope = expanded[..., :n]
        shared = jnp.broadcast_to(k_rope[..., None, :], (*k_nope.shape[:-1], k_rope.shape[-1]))
        return jnp.concatenate([k_nope, shared], axis=-1)

    return named("key", key), named("value", lambda: expanded[..., n:])
