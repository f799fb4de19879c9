"""Causal self-attention core: cuDNN's fused kernel on GPU in half precision, else XLA einsums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def _use_cudnn(dtype, masked: bool) -> bool:
    # cuDNN's fused kernel takes half precision and no arbitrary mask.
    return jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16) and not masked


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
    Scores and softmax are float32 whatever the input dtype. The XLA path takes a value head
    size other than the key's as it is (MLA's); cuDNN's needs it padded.
    """
    kv = v.shape[-1]
    if kv > k.shape[-1]:
        raise ValueError(f"value head size {kv} larger than key head size {k.shape[-1]} is unsupported")
    if _use_cudnn(q.dtype, segment_ids is not None):
        if kv != k.shape[-1]:
            v = jnp.pad(v, [(0, 0), (0, 0), (0, 0), (0, k.shape[-1] - kv)])
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
        return out[..., :kv]
    b, s, h, d = q.shape
    g = k.shape[2]
    r = h // g
    # Heads-major operands, the R query heads of a group stacked along the rows ("m" = (r, s)):
    # both matmuls and their gradients are batched 2-D products over (B, G). Sequence-major
    # einsums differentiate into 5-D dots and transposes that XLA:CPU runs markedly slower
    # (benchmarks/README.md, "What profiling found and fixed").
    qm = q.reshape(b, s, g, r, d).transpose(0, 2, 3, 1, 4).reshape(b, g, r * s, d)
    kh = k.transpose(0, 2, 1, 3)
    vh = v.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bgmd,bgtd->bgmt", qm, kh, preferred_element_type=jnp.float32) * scale
    scores = scores.reshape(b, g, r, s, s)
    allowed = jnp.tril(jnp.ones((s, s), jnp.bool_))[None, None, None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :])
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, g, r * s, s)
    out = jnp.einsum("bgmt,bgtv->bgmv", probs, vh)
    return out.reshape(b, g, r, s, kv).transpose(0, 3, 1, 2, 4).reshape(b, s, h, kv)
