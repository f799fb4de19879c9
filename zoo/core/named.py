"""Named tensors as profile ranges: the ops computing a tensor that placement maps place
(``jax.ad_checkpoint.checkpoint_name``) run under a ``jax.named_scope`` of the same name, so
XProf, Perfetto, Nsight Systems (NVTX ranges) and ``recipes/profile.py`` show the time each
named tensor costs, forward, recomputed and backward (``.../decoder_layer/query/dot_general``).

A scope is metadata only (the ops' ``op_name``): it changes no numerics and no placement.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import jax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import PyTree

T = TypeVar("T", bound=PyTree)


def named(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` computed under the scope ``name``, its result named ``name`` for the
    placement map. Pass the computation as ``fn``: an argument is computed before the scope opens.
    A value computed elsewhere (the layer input) is ``named(name, lambda: x)``: its scope then
    holds only what its placement adds (under a remat policy, the rounding JAX puts on a saved value)."""
    with jax.named_scope(name):
        return checkpoint_name(fn(*args, **kwargs), name)


def region(name: str) -> AbstractContextManager[None]:
    """The scope of named tensor ``name`` alone, around a computation that names the tensor
    itself (attention, whose custom VJPs name their residuals inside)."""
    return jax.named_scope(name)
