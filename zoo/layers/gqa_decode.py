"""Generation for the grouped-query-attention families (Llama, Qwen3): a key/value cache,
prefill and one-token decode steps, given the family's two halves of a layer.

The cache keeps the keys as attention reads them (after RoPE, and whatever the family applies
before it) and the values: ``2·G·K`` numbers per token per layer. A family's model class
derives from :class:`GQAGeneration` and describes its layer (:meth:`GQAGeneration.decode_layers`,
a :class:`GQALayers`):

- ``qkv(layer, h, cos, sin) -> (q, k, v)``: its queries, keys and values of ``h``;
- ``finish(layer, h, ctx, kind) -> h``: the rest of the layer after attention;
- ``runs``: its layer stacks in model order, with each one's kind (``finish`` gets it);
- ``cast(layer)``: the layer's weights in the compute dtype.

Dimension letters: B batch, S prompt positions, T cache slots, D model width, V vocabulary.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo.core.protocol import CausalLM
from zoo.layers.attention import causal_attention
from zoo.layers.embed import embed, unembed
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
from zoo.layers.norm import rms_norm
from zoo.layers.rope import rope_cos_sin

QKV = Callable[[Any, Array, Array, Array], tuple[Array, Array, Array]]
Finish = Callable[[Any, Array, Array, Any], Array]


class GQALayers(NamedTuple):
    """A grouped-query family's layer as the decoder runs it (see the module's docstring)."""

    runs: Sequence[tuple[Any, Any]]
    qkv: QKV
    finish: Finish
    cast: Callable[[Any], Any]


def init_gqa_cache(model: Any, batch: int, max_len: int, **options: Any) -> KVCache:
    """An empty cache of ``max_len`` slots for ``batch`` rows (no cache options)."""
    no_options(model, options)
    check_cache_size(batch, max_len)
    c = model.config
    return KVCache.empty(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, c.head_dim, model.compute_dtype)


def _head(model: Any, x: Float[Array, "B S D"]) -> Float[Array, "B S V"]:
    return unembed(rms_norm(x, model.final_norm, model.config.rms_norm_eps), model.unembedding(), vocab_size=model.config.vocab_size)


def gqa_prefill(
    model: Any,
    input_ids: Int[Array, "B S"],
    lengths: Int[Array, " B"],
    *,
    max_len: int,
    all_logits: bool,
    options: dict[str, Any],
    layers: GQALayers,
) -> tuple[Array, KVCache]:
    """The prompts' cache and the logits of each row's last real token (every position's
    with ``all_logits``)."""
    runs, qkv, finish, cast = layers
    check_prefill(input_ids, max_len)
    cache = init_gqa_cache(model, input_ids.shape[0], max_len, **options)
    config = model.config
    positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)

    def body(h, layer, kind):
        layer = cast(layer)
        q, k, v = qkv(layer, h, cos, sin)
        ctx = causal_attention(q, k, v, scale=config.head_dim**-0.5)
        return finish(layer, h, ctx, kind), (k, v)

    x, (k, v) = prefill_stacks(embed(model.embed, input_ids, model.compute_dtype, vocab_size=model.config.vocab_size), runs, body)
    cache = cache.filled(k, v, lengths)
    if all_logits:
        return _head(model, x), cache
    return _head(model, last_token(x, lengths))[:, 0], cache


def gqa_decode_step(
    model: Any,
    cache: KVCache,
    tokens: Int[Array, " B"],
    layers: GQALayers,
) -> tuple[Float[Array, "B V"], KVCache]:
    """One token per row at each row's next slot: its logits and the cache with it written."""
    runs, qkv, finish, cast = layers
    if not isinstance(cache, KVCache):
        raise TypeError(f"a {type(model).__name__} model decodes with a KVCache, got {type(cache).__name__}")
    config = model.config
    positions = cache.lengths[:, None]
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions)

    def body(h, cache, layer, i, kind):
        layer = cast(layer)
        q, k, v = qkv(layer, h, cos, sin)
        cache = cache.written(i, positions[:, 0], k[:, 0], v[:, 0])
        ctx = cached_attention(q, cache.k[i], cache.v[i], positions, scale=config.head_dim**-0.5)
        return finish(layer, h, ctx, kind), cache

    x, cache = decode_stacks(embed(model.embed, tokens[:, None], model.compute_dtype, vocab_size=model.config.vocab_size), cache, runs, body)
    cache = KVCache(cache.k, cache.v, cache.lengths + 1)
    return _head(model, x)[:, 0], cache


class GQAGeneration(CausalLM):
    """A grouped-query family's generation: the shared cache, prefill and decode step above,
    with the family's layer (:meth:`decode_layers`)."""

    @abc.abstractmethod
    def decode_layers(self) -> GQALayers:
        """The model's layer as the decoder runs it: its halves around attention, its stacks."""

    def init_cache(self, batch: int, max_len: int, **options: Any) -> KVCache:
        return init_gqa_cache(self, batch, max_len, **options)

    def prefill(self, input_ids, lengths, *, max_len: int, all_logits: bool = False, **options: Any):
        return gqa_prefill(
            self, input_ids, lengths, max_len=max_len, all_logits=all_logits, options=options, layers=self.decode_layers()
        )

    def decode_step(self, cache, tokens):
        return gqa_decode_step(self, cache, tokens, self.decode_layers())
