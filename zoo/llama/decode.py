"""Llama generation: a grouped-query key/value cache, prefill and one-token decode steps.

The cache keeps keys after RoPE and values, ``2·G·K`` numbers per token per layer.
Dimension letters as in ``model.py``; T cache slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo.layers import causal_attention, embed, rms_norm, rope_cos_sin, unembed
from zoo.layers.kv_cache import (
    KVCache,
    cached_attention,
    check_cache_size,
    check_prefill,
    decode_stacks,
    last_token,
    no_options,
    prefill_stacks,
)
from zoo.llama.model import llama_post_attention, llama_qkv

if TYPE_CHECKING:
    from zoo.llama.model import Llama


def init_cache(model: Llama, batch: int, max_len: int, **options: Any) -> KVCache:
    no_options(model, options)
    check_cache_size(batch, max_len)
    c = model.config
    return KVCache.empty(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, c.head_dim, model.compute_dtype)


def _head(model: Llama, x: Float[Array, "B S D"]) -> Float[Array, "B S V"]:
    x = rms_norm(x, model.final_norm, model.config.rms_norm_eps)
    return unembed(x, model.unembedding())


def _cast(model: Llama, layer):
    return jax.tree.map(lambda w: w.astype(model.compute_dtype), layer)


def prefill(
    model: Llama, input_ids: Int[Array, "B S"], lengths: Int[Array, " B"], *, max_len: int, all_logits: bool = False, **options: Any
) -> tuple[Array, KVCache]:
    check_prefill(input_ids, max_len)
    cache = init_cache(model, input_ids.shape[0], max_len, **options)
    config = model.config
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)

    def body(h, layer, _):
        layer = _cast(model, layer)
        q, k, v = llama_qkv(config, layer, h, cos, sin)
        ctx = causal_attention(q, k, v, scale=config.head_dim**-0.5)
        return llama_post_attention(config, layer, h, ctx), (k, v)

    x, (k, v) = prefill_stacks(embed(model.embed, input_ids, model.compute_dtype), [(model.layers, None)], body)
    cache = cache.filled(k, v, lengths)
    if all_logits:
        return _head(model, x), cache
    return _head(model, last_token(x, lengths))[:, 0], cache


def decode_step(model: Llama, cache: KVCache, tokens: Int[Array, " B"]) -> tuple[Float[Array, "B V"], KVCache]:
    if not isinstance(cache, KVCache):
        raise TypeError(f"a Llama model decodes with a KVCache, got {type(cache).__name__}")
    config = model.config
    positions = cache.lengths[:, None]
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)

    def body(h, cache, layer, i, _):
        layer = _cast(model, layer)
        q, k, v = llama_qkv(config, layer, h, cos, sin)
        cache = cache.written(i, positions[:, 0], k[:, 0], v[:, 0])
        ctx = cached_attention(q, cache.k[i], cache.v[i], positions, scale=config.head_dim**-0.5)
        return llama_post_attention(config, layer, h, ctx), cache

    x, cache = decode_stacks(embed(model.embed, tokens[:, None], model.compute_dtype), cache, [(model.layers, None)], body)
    cache = KVCache(cache.k, cache.v, cache.lengths + 1)
    return _head(model, x)[:, 0], cache
