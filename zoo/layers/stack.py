"""Running a stack of identical layers with ``jax.lax.scan`` (compile time independent of depth)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

from zoo.hooks import remat_policy

Carry = TypeVar("Carry")


def scan_layers(
    body: Callable[[Carry, Any], tuple[Carry, Any]],
    carry: Carry,
    stacked: Any,
    *,
    policy: Callable[..., Any] | None = None,
) -> tuple[Carry, Any]:
    """``body(carry, layer) -> (carry, out)`` for each layer slice of ``stacked`` (leading axis L).

    ``policy``: a ``jax.checkpoint`` policy for the layer body (from a placement map), or
    ``None`` to keep every intermediate on device. Returns the last carry and the stacked outs.
    """
    policy = remat_policy(policy)  # inside zoo.parallel's step: FSDP re-gathers instead of saving
    fn = body if policy is None else jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(fn, carry, stacked)
