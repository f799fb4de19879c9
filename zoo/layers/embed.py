"""Token embedding and output head (tied or untied)."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from zoo.hooks.step import context_positions, vocab_split
from zoo.hooks import vocab as vocab_parallel


def check_ids_shape(ids, what: str = "input_ids") -> None:
    """``ids`` must be a ``[batch, sequence]`` integer array (named in the error otherwise)."""
    shape = tuple(getattr(ids, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"{what} must be [batch, sequence] token ids, got shape {shape}")
    dtype = getattr(ids, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{what} must be integer token ids, got dtype {dtype}")


def check_token_ids(ids, vocab_size: int, what: str = "input_ids") -> None:
    """A clear error for ids a model cannot take: not ``[batch, sequence]`` integers, or (where
    the values are known, outside ``jit``) an id outside ``0 .. vocab_size - 1``. Inside ``jit``
    nothing checks the values: an id past the table would read garbage (JAX clamps gathers) and a
    negative one wraps, so data is range-checked when it is loaded (:mod:`zoo.data`)."""
    check_ids_shape(ids, what)
    shape = tuple(ids.shape)
    if isinstance(ids, jax.core.Tracer) or 0 in shape:
        return
    values = np.asarray(ids)
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        where = tuple(int(i) for i in np.argwhere(values == bad)[0])
        raise ValueError(f"{what}[{', '.join(map(str, where))}] = {bad} is outside the vocabulary 0..{vocab_size - 1}")


def embed(table: Float[Array, "V D"], ids: Int[Array, "B S"], dtype, *, vocab_size: int | None = None
          ) -> Float[Array, "B S D"]:  # fmt: skip
    """Rows of the embedding table, cast to the compute dtype. ``vocab_size``: the real rows (a
    table laid out on a mesh may have padding rows after them). Inside the parallel step with the
    vocabulary split, ``table`` is this device's block and the lookup is streamed
    (:func:`zoo.hooks.vocab.embed`)."""
    check_token_ids(ids, table.shape[0] if vocab_size is None else vocab_size)
    if (split := vocab_split()) is not None:
        return vocab_parallel.embed(table, ids, dtype, split)
    return jnp.take(table, ids, axis=0).astype(dtype)


def unembed(x: Float[Array, "B S D"], head: Float[Array, "V D"], *, vocab_size: int | None = None
            ) -> Float[Array, "B S V1"]:  # fmt: skip
    """Logits in float32 whatever the compute dtype (accumulated in float32), for the first
    ``vocab_size`` rows of ``head`` (the real vocabulary; padding rows are never logits)."""
    if (split := vocab_split()) is not None:  # the whole head: every logit at once was asked for
        head = vocab_parallel.gather(head, split)
    if vocab_size is not None and vocab_size < head.shape[0]:
        head = head[:vocab_size]
    return jnp.einsum("bsd,vd->bsv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)


def positions_for(input_ids: Int[Array, "B S"], positions: Int[Array, "B S"] | None) -> Int[Array, "B S"]:
    """``positions`` or ``0..S-1`` for every row (a clear error for ids that are not ``[B, S]``);
    under context parallelism the local tokens' places in the whole sequence."""
    check_ids_shape(input_ids)
    if positions is not None:
        return positions
    return jnp.broadcast_to(context_positions(input_ids.shape[1]), input_ids.shape)
