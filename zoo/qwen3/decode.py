"""Qwen3 generation: a grouped-query key/value cache, prefill and one-token decode steps.

The cache keeps the keys after their per-head norm and RoPE, and the values: ``2·G·K`` numbers
per token per layer. Dimension letters as in ``model.py``; T cache slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from zoo.qwen3.model import cast_layer, dense_ffn, layer_runs, moe_ffn, qwen3_attention_out, qwen3_qkv

if TYPE_CHECKING:
    from zoo.qwen3.model import Qwen3


def init_cache(model: Qwen3, batch: int, max_len: int, **options: Any) -> KVCache:
    no_options(model, options)
    check_cache_size(batch, max_len)
    c = model.config
    return KVCache.empty(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, c.head_dim, model.compute_dtype)


def _head(model: Qwen3, x: Float[Array, "B S D"]) -> Float[Array, "B S V"]:
    x = rms_norm(x, model.final_norm, model.config.rms_norm_eps)
    return unembed(x, model.unembedding())


def _ffn(model: Qwen3, layer, h, kind: str):
    if kind == "dense":
        return dense_ffn(model.config, layer, h)
    return moe_ffn(model.config, layer, h, model.expert_impl)[0]


def prefill(
    model: Qwen3, input_ids: Int[Array, "B S"], lengths: Int[Array, " B"], *, max_len: int, all_logits: bool = False, **options: Any
) -> tuple[Array, KVCache]:
    check_prefill(input_ids, max_len)
    cache = init_cache(model, input_ids.shape[0], max_len, **options)
    config = model.config
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)

    def body(h, layer, kind):
        layer = cast_layer(layer, model.compute_dtype)
        q, k, v = qwen3_qkv(config, layer, h, cos, sin)
        ctx = causal_attention(q, k, v, scale=config.head_dim**-0.5)
        return _ffn(model, layer, qwen3_attention_out(layer, h, ctx), kind), (k, v)

    x, (k, v) = prefill_stacks(embed(model.embed, input_ids, model.compute_dtype), layer_runs(model), body)
    cache = cache.filled(k, v, lengths)
    if all_logits:
        return _head(model, x), cache
    return _head(model, last_token(x, lengths))[:, 0], cache


def decode_step(model: Qwen3, cache: KVCache, tokens: Int[Array, " B"]) -> tuple[Float[Array, "B V"], KVCache]:
    if not isinstance(cache, KVCache):
        raise TypeError(f"a Qwen3 model decodes with a KVCache, got {type(cache).__name__}")
    config = model.config
    positions = cache.lengths[:, None]
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)

    def body(h, cache, layer, i, kind):
        layer = cast_layer(layer, model.compute_dtype)
        q, k, v = qwen3_qkv(config, layer, h, cos, sin)
        cache = cache.written(i, positions[:, 0], k[:, 0], v[:, 0])
        ctx = cached_attention(q, cache.k[i], cache.v[i], positions, scale=config.head_dim**-0.5)
        return _ffn(model, layer, qwen3_attention_out(layer, h, ctx), kind), cache

    x, cache = decode_stacks(embed(model.embed, tokens[:, None], model.compute_dtype), cache, layer_runs(model), body)
    cache = KVCache(cache.k, cache.v, cache.lengths + 1)
    return _head(model, x)[:, 0], cache
