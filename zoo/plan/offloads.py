"""Verifying a plan's offloads: every offloaded name really moves to pinned host memory in the
CUDA export of the step (the count is :mod:`zoo.train.hlo`'s, which ``zoo.train.verify`` shares)."""

from __future__ import annotations

import collections
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from zoo.errors import ConfigError
from zoo.placement import PlacementMap, named_tensors
from zoo.plan._step import SDS
from zoo.train.hlo import host_moves, tensor_type


def verify_offloads(model: Any, placement: PlacementMap, seq_len: int) -> tuple[str, ...]:
    """The offloaded names, each checked to move to pinned host memory in the CUDA export of
    one sequence's forward and backward pass; a ConfigError names any that does not."""
    offloaded = placement.placed("pinned_host")
    if not offloaded:
        return ()
    ids = SDS((1, seq_len), jnp.int32)

    def f(m, x):
        return eqx.filter_value_and_grad(lambda m: m.loss(x, placement=placement)[0])(m)

    shapes: dict[str, Any] = {}
    counts: collections.Counter = collections.Counter()
    for name, s in named_tensors(lambda m, x: m.loss(x, placement=placement)[0], model, ids):
        shapes.setdefault(name, s)
        counts[name] += 1
    mlir = jax.export.export(jax.jit(f), platforms=["cuda"])(model, ids).mlir_module()
    moves = host_moves(mlir)
    to_host = collections.Counter({t: n for (where, t), n in moves.items() if where == "pinned_host"})
    need: collections.Counter = collections.Counter()
    for name in offloaded:
        if name in shapes:
            need[tensor_type(shapes[name])] += 1
    missing = [n for n in offloaded if n in shapes and to_host[tensor_type(shapes[n])] < need[tensor_type(shapes[n])]]
    if missing:
        raise ConfigError(f"the plan offloads {missing} but the CUDA export moves no such tensor to pinned host memory")
    return tuple(n for n in offloaded if n in shapes)
