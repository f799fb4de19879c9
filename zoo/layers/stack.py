"""Running a stack of identical layers with ``jax.lax.scan`` (compile time independent of depth)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

from zoo.hooks import remat_policy

Carry = TypeVar("Carry")
LAYER_SCOPE = "decoder_layer"  # the named scope of every scanned layer's ops (zoo.train.trace_report reads it)


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
    The body runs under ``jax.named_scope(LAYER_SCOPE)``: its ops' names carry it, so a profile
    (XProf, Nsight Systems, ``recipes/profile.py``) shows the layers' forward and backward as
    such (one scope for every layer: the scan compiles one body for all of them).
    """
    policy = remat_policy(policy)  # inside zoo.parallel's step: FSDP re-gathers instead of saving

    def scoped(c: Carry, layer: Any) -> tuple[Carry, Any]:
        with jax.named_scope(LAYER_SCOPE):
            return body(c, layer)

    fn = scoped if policy is None else jax.checkpoint(scoped, policy=policy, prevent_cse=False)
    return jax.lax.scan(fn, carry, stacked)
