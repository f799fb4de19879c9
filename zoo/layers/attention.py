"""Causal self-attention core through ``jax.nn.dot_product_attention``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def _implementation(dtype, masked: bool) -> str:
    # cuDNN's fused kernel takes half precision and no arbitrary mask; XLA everywhere else.
    if jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16) and not masked:
        return "cudnn"
    return "xla"


def causal_attention(
    q: Float[Array, "B S H K"],
    k: Float[Array, "B S G K"],
    v: Float[Array, "B S G Kv"],
    *,
    scale: float,
    segment_ids: Int[Array, "B S"] | None = None,
) -> Float[Array, "B S H Kv"]:
    """Softmax(q kᵀ · scale) v over earlier positions of the same segment.

    G key/value heads serve H = G·R query heads (query head h reads key head h // R).
    With ``segment_ids`` (packed sequences) no position attends across a segment boundary.
    A value head size different from the key's is zero-padded for the kernel and sliced back.
    """
    kv = v.shape[-1]
    if kv != k.shape[-1]:
        if kv > k.shape[-1]:
            raise ValueError(f"value head size {kv} larger than key head size {k.shape[-1]} is unsupported")
        v = jnp.pad(v, [(0, 0), (0, 0), (0, 0), (0, k.shape[-1] - kv)])
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    # JAX's own XLA path promotes bf16 scores to f32 implicitly, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        out = jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=True, implementation=_implementation(q.dtype, mask is not None)
        )
    return out[..., :kv]
