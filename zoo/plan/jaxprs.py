"""Walking a traced program: the calls whose body runs inline, a call's jaxpr, the jaxpr inside a
closed one, a value's bytes, and the loops priced as not run. The liveness walk (``zoo.plan._liveness``), the FLOP count of a
layer (``zoo.plan._flops``) and the collectives' count (``zoo.plan.collectives``) share them."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax.extend.core import ClosedJaxpr  # jax 0.12 has it here only, not in jax._src.core

from zoo.layers.moe_dispatch import LATER_ROUNDS

# Calls whose body is inlined into the caller's order.
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call",
                   "custom_vjp_call", "custom_vjp_call_jaxpr", "shard_map", "custom_lin"})  # fmt: skip


def later_rounds(eqn: core.JaxprEqn) -> bool:
    """A MoE dispatch's loop of later all-to-all rounds (:mod:`zoo.layers.moe_dispatch`), priced
    as not run: with the aux-loss-free bias, each destination's pairs fit its first round's slot.
    (Its buffers still count towards memory: when the routing does overflow, they are live.)"""
    return eqn.primitive.name == "while" and LATER_ROUNDS in str(eqn.source_info.name_stack)


def has_scope(jaxpr: Any, scope: str) -> bool:
    """Whether any equation of ``jaxpr`` (a closed one too), or of a jaxpr inside one, was traced
    under the name scope ``scope`` (inside a transformation too: ``jvp(scope)``)."""
    for eqn in jaxpr_of(jaxpr).eqns:
        if any(part.rstrip(")").rsplit("(", 1)[-1] == scope for part in str(eqn.source_info.name_stack).split("/")):
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (core.Jaxpr, ClosedJaxpr)) and has_scope(sub, scope):
                    return True
    return False


def nbytes(aval: Any) -> int:
    """Bytes of one value (0 for tokens and other non-arrays)."""
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # a PRNG key: its raw data (LoRA dropout's keys)
        impl = dtype._impl
        return math.prod(shape) * math.prod(impl.key_shape) * np.dtype(jnp.uint32).itemsize
    return math.prod(shape) * np.dtype(dtype).itemsize


def jaxpr_of(x: Any) -> core.Jaxpr:
    """The jaxpr of ``x``: a closed jaxpr's own, else ``x``."""
    return x.jaxpr if isinstance(x, ClosedJaxpr) else x


def scan_operands(params: Any) -> tuple[int, int]:
    """A scan equation's constants and carries among its operands, in that order before its
    scanned inputs: ``num_consts`` and ``num_carry`` up to jax 0.12.0, the sizes of the first two
    groups of ``ft_in`` from 0.12.1."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].unpack()
    return len(consts), len(carries)


def call_jaxpr(eqn: core.JaxprEqn) -> Any:
    """The jaxpr a call equation runs (its ``jaxpr``, ``call_jaxpr`` or ``fun_jaxpr``); None if none."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            return eqn.params[key]
    return None
