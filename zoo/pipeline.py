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
runs as without pipelining. Per-layer outputs (router statistics: expert load, balance
losses) are combined over the micro-batches per stage and placed over the stages the same way
(:func:`pipelined_scan`'s ``combine``). Autodiff gives the backward schedule: the transpose of each
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
                f"got shape {tuple(x.shape)} (a sum over the rows goes out as a per-layer output with combine='sum', not in the carry)"
            )
        return x.reshape(m, rows // m, *x.shape[1:])

    return jax.tree.map(cut, tree)


def _typed_like(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


COMBINE = ("sum", "mean", "rows")


def _combine_kinds(combine: PyTree, outs: PyTree) -> PyTree:
    """Per leaf of the per-layer outputs, how its micro-batches' values combine: ``combine``
    broadcast over ``outs`` (a prefix of it), or by dtype where ``None``: integer leaves
    (counts) summed, floating leaves (means over equal-size micro-batches) averaged."""
    if combine is None:
        return jax.tree.map(lambda x: "sum" if jnp.issubdtype(x.dtype, jnp.integer) else "mean", outs)

    def spread(kind, sub):
        if kind not in COMBINE:
            raise MeshError(f"pipeline: combine must name one of {COMBINE} per output, got {kind!r}")
        return jax.tree.map(lambda _: kind, sub)

    return jax.tree.map(spread, combine, outs)


def pipelined_scan(
    layer_fn: Callable[[Any, Any, Any], tuple[Any, Any]],
    carry: PyTree,
    stacked: PyTree,
    rows: PyTree,
    split: PipelineSplit,
    n_layers: int,
    combine: PyTree = None,
) -> tuple[PyTree, PyTree]:
    """``layer_fn(carry, layer, rows) -> (carry, out)`` over every layer of a pipelined stack,
    this device holding ``stacked``'s block of it; returns the whole stack's output carry and
    its per-layer outputs stacked over the ``n_layers`` real layers, both on every stage, as
    ``jax.lax.scan`` over the whole stack on one device would.

    ``carry`` (the residual stream) and ``rows`` (per-row inputs: RoPE tables, segment ids) lead
    with the device's rows, which ``split.microbatches`` must divide. (A quantity summed over
    the rows is a per-layer output with ``combine="sum"``, not a carry.) Each per-layer output
    is combined over the micro-batches as ``combine`` says, per leaf (a prefix of ``out``):
    ``"sum"`` (counts, sums over rows), ``"mean"`` (means over the rows: exact, the micro-batches
    are equal in size), ``"rows"`` (the leaf leads with the micro-batch's rows: concatenated
    back); ``None``: integer leaves summed, floating leaves averaged. Padding layers' outputs
    are zeros and cut off."""
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
            real = stage * per_stage + i < n_layers
            return jax.tree.map(lambda a, b: jnp.where(real, a, b), new, c), out

        return jax.lax.scan(one, c, (stacked, jnp.arange(per_stage)))

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
        y, outs = stage_layers(inputs, jax.tree.map(lambda x: x[at], micro_rows))
        keep = active & (stage == stages - 1)
        outputs = jax.tree.map(
            lambda o, v: jax.lax.dynamic_update_index_in_dim(o, jnp.where(keep, v, o[at]), at, 0), outputs, y
        )
        sent = jax.tree.map(lambda v: jax.lax.ppermute(v, PIPELINE, forward), y)
        return (sent, outputs), outs

    (_, outputs), per_tick = jax.lax.scan(tick, (first, outputs), jnp.arange(m + stages - 1))
    last = stage == stages - 1
    whole = jax.tree.map(lambda o: jax.lax.psum(jnp.where(last, o, jnp.zeros_like(o)), PIPELINE), outputs)
    carry_out = jax.tree.map(lambda o: o.reshape(n_rows, *o.shape[2:]), whole)
    return carry_out, _gather_outputs(per_tick, _combine_kinds(combine, per_tick), stage, split, per_stage, n_layers)


def _gather_outputs(per_tick: PyTree, kinds: PyTree, stage, split: PipelineSplit, per_stage: int, n_layers: int):
    """The per-layer outputs of every stage's layers, ``[n_layers, ...]`` on every stage, from
    this stage's per-tick outputs ``[ticks, per_stage, ...]``: stage ``s`` worked on micro-batch
    ``j`` at tick ``s + j``; padding layers' outputs zeroed and cut off."""
    stages, m = split.stages, split.microbatches
    real = stage * per_stage + jnp.arange(per_stage) < n_layers
    mine = jnp.arange(stages) == stage

    def one(y, kind):
        y = jax.lax.dynamic_slice_in_dim(y, stage, m, axis=0)  # [m, per_stage, ...]: this stage's micro-batches
        if kind == "sum":
            y = jnp.sum(y, axis=0)
        elif kind == "mean":
            y = jnp.mean(y, axis=0)
        else:  # [m, per_stage, rows/m, ...] -> [per_stage, rows, ...]
            y = jnp.moveaxis(y, 0, 1)
            y = y.reshape(per_stage, -1, *y.shape[3:])
        y = jnp.where(real.reshape(-1, *(1,) * (y.ndim - 1)), y, jnp.zeros_like(y))
        # Each stage's block in its place, the others zeros; a psum (not an all-gather) so the
        # result is typed the same on every stage, as what follows the stack must be.
        full = jnp.where(mine.reshape(-1, *(1,) * y.ndim), y[None], jnp.zeros_like(y)[None])
        full = jax.lax.psum(full.reshape(stages * per_stage, *y.shape[1:]), PIPELINE)
        return full[:n_layers]

    return jax.tree.map(one, per_tick, kinds)
