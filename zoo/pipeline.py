"""Pipeline parallelism: a layer stack split into stages over the ``"pipeline"`` mesh axis.

Inside :func:`zoo.parallel.value_and_grad`'s ``shard_map`` each device of the ``pipeline`` axis
holds one contiguous block of a pipelined stack's layers (the stacked ``L`` axis split over it,
padded to a multiple of the stage count with zero layers that are skipped). The step's rows are
not split over ``pipeline``: every stage sees the same rows, cuts them into ``M`` micro-batches,
and the micro-batches flow through the stages on a GPipe schedule: at tick ``t`` stage ``s``
runs its layers on micro-batch ``t - s`` and hands the result to stage ``s + 1`` with
``ppermute``; ``M + P - 1`` ticks fill and drain the ``P`` stages, a bubble of
``(P - 1) / (M + P - 1)`` of the step. The last stage's outputs are then broadcast to every
stage (a ``psum`` of one non-zero term), so what follows the stack (final norm, head, loss)
runs as without pipelining. Autodiff gives the backward schedule: the transpose of each
``ppermute`` sends gradients one stage back, ticks in reverse.

Each stage's layers run under ``jax.lax.scan`` with the placement map's policy, as without
pipelining, so every in-flight micro-batch's named tensors are kept, recomputed or offloaded
as the map says; the backward pass finds all ``M`` micro-batches' saved tensors (GPipe).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from zoo.errors import MeshError
from zoo.hooks import PIPELINE, PipelineSplit, varying_axes


def bubble(stages: int, microbatches: int) -> float:
    """The GPipe schedule's idle fraction: ``(P - 1) / (M + P - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


def _split_rows(tree: PyTree, m: int, rows: int, what: str) -> PyTree:
    def cut(x):
        if x.ndim == 0 or x.shape[0] != rows:
            raise MeshError(
                f"pipeline: every {what} array must lead with the {rows} rows of the residual stream, "
                f"got shape {tuple(x.shape)} (a stack whose carry accumulates across rows is not pipelined yet)"
            )
        return x.reshape(m, rows // m, *x.shape[1:])

    return jax.tree.map(cut, tree)


def _typed_like(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def pipelined_scan(
    layer_fn: Callable[[Any, Any, Any], tuple[Any, Any]],
    carry: PyTree,
    stacked: PyTree,
    rows: PyTree,
    split: PipelineSplit,
    n_layers: int,
) -> tuple[PyTree, None]:
    """``layer_fn(carry, layer, rows) -> (carry, None)`` over every layer of a pipelined stack,
    this device holding ``stacked``'s block of it; returns the whole stack's output carry (on
    every stage) and ``None`` (per-layer outputs are not gathered across stages).

    ``carry`` (the residual stream) and ``rows`` (per-row inputs: RoPE tables, segment ids) lead
    with the device's rows, which ``split.microbatches`` must divide."""
    stages, m = split.stages, split.microbatches
    leaves = jax.tree.leaves(carry)
    if not leaves:
        raise MeshError("pipeline: a pipelined stack needs a carry (the residual stream)")
    n_rows = leaves[0].shape[0]
    if n_rows % m:
        raise MeshError(
            f"pipeline: microbatches={m} must divide each device's {n_rows} rows (the batch over its batch axes)"
        )
    per_stage = jax.tree.leaves(stacked)[0].shape[0]
    stage = jax.lax.axis_index(PIPELINE)
    micro = _split_rows(carry, m, n_rows, "carry")
    micro_rows = _split_rows(rows, m, n_rows, "row input")

    def stage_layers(c, r):
        """This stage's layers on one micro-batch; padding layers (past ``n_layers``) skipped."""

        def one(c, layer_i):
            layer, i = layer_i
            new, out = layer_fn(c, layer, r)
            if out is not None:
                raise MeshError("pipeline: a pipelined stack's layers must return no per-layer outputs yet")
            real = stage * per_stage + i < n_layers
            return jax.tree.map(lambda a, b: jnp.where(real, a, b), new, c), None

        return jax.lax.scan(one, c, (stacked, jnp.arange(per_stage)))[0]

    # The hand-over buffer and the last stage's outputs vary over the pipeline axis (ppermute
    # and the stage index make them differ) as well as over whatever the rows vary over.
    kinds = jax.tree.map(lambda x: varying_axes(x) | {PIPELINE}, micro)
    first = jax.tree.map(lambda x, k: _typed_like(jnp.zeros_like(x[0]), k), micro, kinds)
    outputs = jax.tree.map(lambda x, k: _typed_like(jnp.zeros_like(x), k), micro, kinds)
    forward = [(i, i + 1) for i in range(stages - 1)]

    def tick(state, t):
        received, outputs = state
        mb = t - stage  # the micro-batch this stage works on at tick t
        active = (mb >= 0) & (mb < m)
        at = jnp.clip(mb, 0, m - 1)
        fed = jax.tree.map(lambda x: x[jnp.clip(t, 0, m - 1)], micro)
        inputs = jax.tree.map(lambda a, b: jnp.where(stage == 0, a, b), fed, received)
        y = stage_layers(inputs, jax.tree.map(lambda x: x[at], micro_rows))
        keep = active & (stage == stages - 1)
        outputs = jax.tree.map(
            lambda o, v: jax.lax.dynamic_update_index_in_dim(o, jnp.where(keep, v, o[at]), at, 0), outputs, y
        )
        sent = jax.tree.map(lambda v: jax.lax.ppermute(v, PIPELINE, forward), y)
        return (sent, outputs), None

    (_, outputs), _ = jax.lax.scan(tick, (first, outputs), jnp.arange(m + stages - 1))
    last = stage == stages - 1
    whole = jax.tree.map(lambda o: jax.lax.psum(jnp.where(last, o, jnp.zeros_like(o)), PIPELINE), outputs)
    return jax.tree.map(lambda o: o.reshape(n_rows, *o.shape[2:]), whole), None
