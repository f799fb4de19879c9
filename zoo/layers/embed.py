"""Token embedding and output head (tied or untied)."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def embed(table: Float[Array, "V D"], ids: Int[Array, "B S"], dtype) -> Float[Array, "B S D"]:
    """Rows of the embedding table, cast to the compute dtype."""
    return jnp.take(table, ids, axis=0).astype(dtype)


def unembed(x: Float[Array, "B S D"], head: Float[Array, "V D"]) -> Float[Array, "B S V"]:
    """Logits in float32 whatever the compute dtype (accumulated in float32)."""
    return jnp.einsum("bsd,vd->bsv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
