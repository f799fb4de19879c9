"""Llama generation: the shared grouped-query decoder (``zoo.layers.gqa_decode``) with
Llama's layer. The cache keeps keys after RoPE and values, ``2·G·K`` numbers per token per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from jaxtyping import Array, Float, Int

from zoo.layers.gqa_decode import gqa_decode_step, gqa_prefill, init_gqa_cache
from zoo.layers.kv_cache import KVCache
from zoo.llama.model import llama_post_attention, llama_qkv

if TYPE_CHECKING:
    from zoo.llama.model import Llama


def init_cache(model: Llama, batch: int, max_len: int, **options: Any) -> KVCache:
    return init_gqa_cache(model, batch, max_len, **options)


def _layer(model: Llama) -> dict[str, Any]:
    config = model.config
    return {
        "runs": [(model.layers, None)],
        "qkv": lambda layer, h, cos, sin: llama_qkv(config, layer, h, cos, sin),
        "finish": lambda layer, h, ctx, _: llama_post_attention(config, layer, h, ctx),
        "cast": lambda layer: jax.tree.map(lambda w: w.astype(model.compute_dtype), layer),
    }


def prefill(
    model: Llama, input_ids: Int[Array, "B S"], lengths: Int[Array, " B"], *, max_len: int, all_logits: bool = False, **options: Any
) -> tuple[Array, KVCache]:
    return gqa_prefill(model, input_ids, lengths, max_len=max_len, all_logits=all_logits, options=options, **_layer(model))


def decode_step(model: Llama, cache: KVCache, tokens: Int[Array, " B"]) -> tuple[Float[Array, "B V"], KVCache]:
    return gqa_decode_step(model, cache, tokens, **_layer(model))
