"""Qwen3 generation: the shared grouped-query decoder (``zoo.layers.gqa_decode``) with Qwen3's
layers, dense and MoE. The cache keeps the keys after their per-head norm and RoPE, and the
values: ``2·G·K`` numbers per token per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxtyping import Array, Float, Int

from zoo.layers.gqa_decode import gqa_decode_step, gqa_prefill, init_gqa_cache
from zoo.layers.kv_cache import KVCache
from zoo.qwen3.model import cast_layer, dense_ffn, layer_runs, moe_ffn, qwen3_attention_out, qwen3_qkv

if TYPE_CHECKING:
    from zoo.qwen3.model import Qwen3


def init_cache(model: Qwen3, batch: int, max_len: int, **options: Any) -> KVCache:
    return init_gqa_cache(model, batch, max_len, **options)


def _layer(model: Qwen3) -> dict[str, Any]:
    config = model.config

    def finish(layer, h, ctx, kind):
        h = qwen3_attention_out(layer, h, ctx)
        return dense_ffn(config, layer, h) if kind == "dense" else moe_ffn(config, layer, h, model.expert_impl)[0]

    return {
        "runs": layer_runs(model),
        "qkv": lambda layer, h, cos, sin: qwen3_qkv(config, layer, h, cos, sin),
        "finish": finish,
        "cast": lambda layer: cast_layer(layer, model.compute_dtype),
    }


def prefill(
    model: Qwen3, input_ids: Int[Array, "B S"], lengths: Int[Array, " B"], *, max_len: int, all_logits: bool = False, **options: Any
) -> tuple[Array, KVCache]:
    return gqa_prefill(model, input_ids, lengths, max_len=max_len, all_logits=all_logits, options=options, **_layer(model))


def decode_step(model: Qwen3, cache: KVCache, tokens: Int[Array, " B"]) -> tuple[Float[Array, "B V"], KVCache]:
    return gqa_decode_step(model, cache, tokens, **_layer(model))
