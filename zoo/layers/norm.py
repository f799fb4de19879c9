"""RMSNorm, computed in float32 whatever the input dtype (as Llama and DeepSeek-V3 do)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def rms_norm(x: Float[Array, "*B D"], weight: Float[Array, " D"], eps: float) -> Float[Array, "*B D"]:
    """``weight * x / rms(x)``; the normalisation runs in float32, the product in ``x.dtype``."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * h.astype(x.dtype)
