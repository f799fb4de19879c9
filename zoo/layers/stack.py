"""Running a stack of identical layers with ``jax.lax.scan`` (compile time independent of depth)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jaxtyping import Array, Float


def scan_layers(
    body: Callable[[Float[Array, "B S D"], Any], Float[Array, "B S D"]],
    x: Float[Array, "B S D"],
    stacked: Any,
    *,
    policy: Callable[..., Any] | None = None,
    collect: bool = False,
) -> tuple[Float[Array, "B S D"], Float[Array, "L B S D"] | None]:
    """Apply ``body(x, layer)`` for each layer slice of ``stacked`` (leading axis L) in turn.

    ``policy``: a ``jax.checkpoint`` policy for the layer body (from a placement map), or
    ``None`` to keep every intermediate on device. ``collect``: also return each layer's output.
    """
    fn = body if policy is None else jax.checkpoint(body, policy=policy, prevent_cse=False)

    def step(carry, layer):
        out = fn(carry, layer)
        return out, (out if collect else None)

    x, ys = jax.lax.scan(step, x, stacked)
    return x, ys
