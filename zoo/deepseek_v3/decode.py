"""DeepSeek-V3 generation: the compressed MLA cache, decoding by weight absorption, prefill.

Caches:

- :class:`MLACache` (the default): only the normalised kv latent and the rotated rope key,
  ``C + P`` numbers per token per layer, shared by all heads. Decoding absorbs the key half
  of ``kv_b_proj`` into the query (``q_nope · W_k`` lands in the latent space), attends over
  the latent cache directly, and applies the value half once to the attended latent: keys
  and values are never expanded for the context.
- ``mla="expanded"`` gives an ordinary per-head :class:`~zoo.layers.kv_cache.KVCache`
  (``H·(K + U)`` numbers) and ``mla="reexpand"`` an :class:`MLACache` re-expanded for the
  whole context every step (what MaxText and jax-llm-examples do); both are references
  for the tests and the benchmark.

The prefill runs the model's ordinary (expanded) attention over the prompt: for S queries
at once, attention over the latent would cost ``S²·H·(2C + P)`` against ``S²·H·(K + U)``
expanded (3x more for DeepSeek-V3's C=512, K=192, U=128), while expanding the prompt's
latent costs only ``S·C·H·(N + U)``. Decoding one token is the opposite case: expansion
would cost ``T·C·H·(N + U)`` per step, absorption ``H·N·C + H·C·U``.

Dimension letters as in ``model.py``; T cache slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo.deepseek_v3.config import DeepseekV3Config
from zoo.deepseek_v3.layer import cast_moe, dense_layer_ffn, moe_layer_ffn
from zoo.deepseek_v3.mla import MLA, mla_expand, mla_project
from zoo.layers import causal_attention, embed, rms_norm, rope_cos_sin, unembed
from zoo.layers.kv_cache import (
    KVCache,
    SlotCache,
    cached_attention,
    check_cache_size,
    check_prefill,
    decode_stacks,
    fill,
    last_token,
    masked_softmax,
    prefill_stacks,
    visible,
    write_token,
)

if TYPE_CHECKING:
    from zoo.deepseek_v3.model import DeepseekV3

MLADecode = Literal["absorbed", "reexpand", "expanded"]
MLA_DECODES: tuple[str, ...] = ("absorbed", "reexpand", "expanded")


class MLACache(SlotCache):
    """DeepSeek-V3's compressed cache: per token and layer, the normalised kv latent (C)
    and the rotated rope key (P), shared by every head (``L · (C + P) · itemsize`` bytes a
    token). ``absorb``: decode by weight absorption (``False``: re-expand keys and values for
    the whole context every step)."""

    latent: Float[Array, "L B T C"]
    k_rope: Float[Array, "L B T P"]
    lengths: Int[Array, " B"]
    absorb: bool = eqx.field(static=True, default=True)

    @property
    def max_len(self) -> int:
        return self.latent.shape[2]


def init_cache(model: DeepseekV3, batch: int, max_len: int, *, mla: MLADecode = "absorbed") -> KVCache | MLACache:
    """An empty cache in the model's compute dtype: the compressed :class:`MLACache`
    (``mla="absorbed"`` or ``"reexpand"``) or a per-head ``KVCache`` (``"expanded"``)."""
    if mla not in MLA_DECODES:
        raise ValueError(f"mla must be one of {MLA_DECODES}, got {mla!r}")
    check_cache_size(batch, max_len)
    c, dtype = model.config, model.compute_dtype
    if mla == "expanded":
        return KVCache.empty(c.num_layers, batch, max_len, c.num_heads, c.qk_head_dim, c.v_head_dim, dtype)
    return MLACache(
        jnp.zeros((c.num_layers, batch, max_len, c.kv_lora_rank), dtype),
        jnp.zeros((c.num_layers, batch, max_len, c.qk_rope_head_dim), dtype),
        jnp.zeros((batch,), jnp.int32),
        absorb=mla == "absorbed",
    )


def absorbed_attention(
    config: DeepseekV3Config,
    p: MLA,
    q: Float[Array, "B S H K"],
    latent: Float[Array, "B T C"],
    k_rope: Float[Array, "B T P"],
    positions: Int[Array, "B S"],
) -> Float[Array, "B S H U"]:
    """MLA attention over the compressed cache by weight absorption.

    With ``W_k = wkv_b[..., :N]`` and ``W_v = wkv_b[..., N:]`` (``C H N`` / ``C H U``), the
    expanded path's score ``q_nope · (latent W_k) + q_rope · k_rope`` equals
    ``(q_nope W_kᵀ) · latent + q_rope · k_rope``, and its context ``Σ_t p_t (latent_t W_v)``
    equals ``(Σ_t p_t latent_t) W_v``: queries move into the latent space once per token,
    every head reads the same ``C + P`` numbers per cached token (multi-query attention
    over the latent), and ``W_v`` is applied once to the attended latent.
    """
    n = config.qk_nope_head_dim
    w_k, w_v = p.wkv_b[..., :n], p.wkv_b[..., n:]
    q_latent = jnp.einsum("bshn,chn->bshc", q[..., :n], w_k)
    scores = jnp.einsum("bshc,btc->bhst", q_latent, latent, preferred_element_type=jnp.float32)
    scores = scores + jnp.einsum("bshp,btp->bhst", q[..., n:], k_rope, preferred_element_type=jnp.float32)
    probs = masked_softmax(scores * config.softmax_scale, visible(positions, latent.shape[1])[:, None])
    ctx_latent = jnp.einsum("bhst,btc->bshc", probs.astype(latent.dtype), latent)
    return jnp.einsum("bshc,chu->bshu", ctx_latent, w_v)


def _heads_first(x: Float[Array, "B T H K"]) -> Float[Array, "B H T K"]:
    return jnp.swapaxes(x, 1, 2)


def mla_decode(
    config: DeepseekV3Config,
    p: MLA,
    h: Float[Array, "B 1 D"],
    cos: Float[Array, "B 1 R"],
    sin: Float[Array, "B 1 R"],
    cache: KVCache | MLACache,
    i: Int[Array, ""],
    positions: Int[Array, "B 1"],
) -> tuple[Float[Array, "B 1 D"], KVCache | MLACache]:
    """One layer's attention for one new token per row; returns its output and the cache."""
    q, latent, k_rope = mla_project(config, p, h, cos, sin)
    pos = positions[:, 0]
    if isinstance(cache, KVCache):  # expanded: expand the new token only, cache per-head keys and values
        k, v = mla_expand(config, p, latent, k_rope)
        cache = cache.written(i, pos, k[:, 0], v[:, 0])
        ctx = cached_attention(q, cache.k[i], cache.v[i], positions, scale=config.softmax_scale)
    else:
        lat, kr = write_token(cache.latent, i, pos, latent[:, 0]), write_token(cache.k_rope, i, pos, k_rope[:, 0])
        if cache.absorb:
            ctx = absorbed_attention(config, p, q, lat[i], kr[i], positions)
        else:  # re-expand keys and values for every cached position (the reference)
            k, v = mla_expand(config, p, lat[i], kr[i])
            ctx = cached_attention(q, _heads_first(k), _heads_first(v), positions, scale=config.softmax_scale)
        cache = eqx.tree_at(lambda c: (c.latent, c.k_rope), cache, (lat, kr))
    return jnp.einsum("bshu,hud->bsd", ctx, p.wo), cache


def _head(model: DeepseekV3, x: Float[Array, "B S D"]) -> Float[Array, "B S V"]:
    x = rms_norm(x, model.final_norm, model.config.rms_norm_eps)
    return unembed(x, model.unembedding(), vocab_size=model.config.vocab_size)


def _cast(model: DeepseekV3, layer, moe: bool):
    if moe:
        return cast_moe(layer, model.compute_dtype)
    return jax.tree.map(lambda w: w.astype(model.compute_dtype), layer)


def _stacks(model: DeepseekV3) -> list[tuple[Any, bool]]:
    """The layer stacks in order: (stacked layers, is MoE)."""
    out = []
    if model.dense_layers is not None:
        out.append((model.dense_layers, False))
    if model.moe_layers is not None:
        out.append((model.moe_layers, True))
    return out


def _ffn(model: DeepseekV3, layer, h, moe: bool):
    config = model.config
    return moe_layer_ffn(config, layer, h, model.expert_impl)[0] if moe else dense_layer_ffn(config, layer, h)


def prefill(
    model: DeepseekV3,
    input_ids: Int[Array, "B S"],
    lengths: Int[Array, " B"],
    *,
    max_len: int,
    all_logits: bool = False,
    mla: MLADecode = "absorbed",
) -> tuple[Array, KVCache | MLACache]:
    check_prefill(input_ids, max_len)
    cache = init_cache(model, input_ids.shape[0], max_len, mla=mla)
    config = model.config
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    cos, sin = rope_cos_sin(config.rope, config.qk_rope_head_dim, positions)

    def body(h, layer, moe):
        layer = _cast(model, layer, moe)
        a = layer.attn
        q, latent, k_rope = mla_project(config, a, rms_norm(h, layer.attn_norm, config.rms_norm_eps), cos, sin)
        k, v = mla_expand(config, a, latent, k_rope)
        ctx = causal_attention(q, k, v, scale=config.softmax_scale)
        h = _ffn(model, layer, h + jnp.einsum("bshu,hud->bsd", ctx, a.wo), moe)
        return h, ((k, v) if mla == "expanded" else (latent, k_rope))

    x, stored = prefill_stacks(embed(model.embed, input_ids, model.compute_dtype, vocab_size=model.config.vocab_size), _stacks(model), body)
    if isinstance(cache, KVCache):
        cache = cache.filled(*stored, lengths)
    else:
        latent, k_rope = (fill(buf, e) for buf, e in zip((cache.latent, cache.k_rope), stored))
        cache = MLACache(latent, k_rope, lengths.astype(jnp.int32), absorb=cache.absorb)
    if all_logits:
        return _head(model, x), cache
    return _head(model, last_token(x, lengths))[:, 0], cache


def decode_step(
    model: DeepseekV3, cache: KVCache | MLACache, tokens: Int[Array, " B"]
) -> tuple[Float[Array, "B V"], KVCache | MLACache]:
    if not isinstance(cache, (KVCache, MLACache)):
        raise TypeError(f"a DeepseekV3 model decodes with an MLACache or a KVCache, got {type(cache).__name__}")
    config = model.config
    positions = cache.lengths[:, None]
    cos, sin = rope_cos_sin(config.rope, config.qk_rope_head_dim, positions)

    def body(h, cache, layer, i, moe):
        layer = _cast(model, layer, moe)
        a = rms_norm(h, layer.attn_norm, config.rms_norm_eps)
        out, cache = mla_decode(config, layer.attn, a, cos, sin, cache, i, positions)
        return _ffn(model, layer, h + out, moe), cache

    x, cache = decode_stacks(embed(model.embed, tokens[:, None], model.compute_dtype, vocab_size=model.config.vocab_size), cache, _stacks(model), body)
    cache = eqx.tree_at(lambda c: c.lengths, cache, cache.lengths + 1)
    return _head(model, x)[:, 0], cache
