"""Row gathers of the MoE paths: rows of an array by index, zeros where a mask says so."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, Shaped


def take_rows(x: Shaped[Array, "N D"], index: Int[Array, "*idx"], valid: Bool[Array, "*idx"]) -> Shaped[Array, "*idx D"]:
    """Rows ``x[index]``, zeros where not ``valid``: one gather that fills the rows it is not
    given (their index is out of range), not a gather and a select. Bit for bit the same values;
    the traced program holds one buffer of the rows where it held two, and XLA:CPU's compiled
    MoE step holds less too (docs/planning.md, "The seed")."""
    return jnp.take(x, jnp.where(valid, index, x.shape[0]), axis=0, mode="fill", fill_value=0)
