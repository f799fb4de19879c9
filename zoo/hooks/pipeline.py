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

The 1F1B schedule (:mod:`zoo.parallel.one_f_one_b`) runs the backward pass inside the tick loop
instead, so it needs the loss cut at its stack: :func:`split_at_stack` traces the loss with the
stack's call recorded (:class:`AtStack`) or replaced by a given output, :func:`batch_total`
gives each micro-batch's loss the whole batch's denominators and :func:`stack_total` the whole
batch's totals of what the stack computes (a forward pass over the whole batch first).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, PyTree, Shaped

from zoo.core.mesh import PIPELINE, chunk_size, virtual_fits, virtual_options
from zoo.errors import MeshError
from zoo.hooks.step import PipelineSplit, global_sum, varying_axes


def bubble(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The schedule's idle fraction: ``(P - 1) / (V·M + P - 1)`` (GPipe: ``V = 1``)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def chunk_layers(stages: int, virtual: int, per_stage: int) -> Int[np.ndarray, "P V c"]:
    """The layer (in stack order, padding included) at position ``j`` of chunk ``v`` of stage
    ``s``, ``-1`` past the end of a short last chunk. A micro-batch runs the chunks in the
    ring's order, chunk ``v`` of every stage before chunk ``v + 1``, so the layers number the
    chunks' positions in that order; with equal chunks of ``c``, ``(v·P + s)·c + j``."""
    if not virtual_fits(per_stage, virtual):
        raise MeshError(
            f"pipeline: virtual_stages={virtual} cannot split a stage's {per_stage} layers into chunks of "
            f"{chunk_size(per_stage, max(virtual, 1))} (one would be empty); possible: {virtual_options(per_stage)}"
        )
    c = chunk_size(per_stage, virtual)
    held = np.arange(virtual)[:, None] * c + np.arange(c)[None, :] < per_stage  # [V, c]
    held = np.broadcast_to(held[:, None, :], (virtual, stages, c)).ravel()  # ring order: [V, P, c]
    layer = np.where(held, np.cumsum(held) - 1, -1)
    return layer.reshape(virtual, stages, c).transpose(1, 0, 2)


def chunk_place(layer_at: Int[Array, "P V c"], per_stage: int, n_layers: int, stage: Int[Array, ""],
                v: Int[Array, ""], j: Int[Array, ""]) -> tuple[Int[Array, ""], Bool[Array, ""]]:  # fmt: skip
    """Place ``j`` of this stage's chunk ``v``: its position in the stage's stored block (the
    last one past a short chunk's end, whose result the caller discards) and whether it is a
    real layer (not padding, not past the chunk's end); ``layer_at``: :func:`chunk_layers`."""
    index = layer_at[stage, v, j]
    return jnp.minimum(v * layer_at.shape[2] + j, per_stage - 1), (index >= 0) & (index < n_layers)


def chunk_positions(stages: int, virtual: int, per_stage: int, n_layers: int) -> Int[np.ndarray, " n"]:
    """For each of the first ``n_layers`` layers, its place among every stage's chunk positions
    laid out ``[V, P, c]`` (flattened): where a layer's per-layer output is in that layout."""
    table = chunk_layers(stages, virtual, per_stage).transpose(1, 0, 2).ravel()
    where = np.empty(stages * per_stage, np.int64)
    where[table[table >= 0]] = np.flatnonzero(table >= 0)
    return where[:n_layers]


def in_layer_order(full: Shaped[Array, "n *rest"], stages: int, virtual: int, per_stage: int,
                   n_layers: int) -> Shaped[Array, "layers *rest"]:  # fmt: skip
    """Per-layer values laid out over every stage's chunk positions ``[V·P·c, ...]``, as the
    first ``n_layers`` layers in stack order (:func:`chunk_positions`)."""
    where = chunk_positions(stages, virtual, per_stage, n_layers)
    return full[:n_layers] if np.array_equal(where, np.arange(n_layers)) else full[where]


def stage_order(layers: int, stages: int, virtual: int) -> Int[np.ndarray, " L"]:
    """For a stack of ``layers`` (padded: ``stages`` divides it) in stage order, the layer at
    each stored position: device ``s`` holds its ``virtual`` chunks (:func:`chunk_layers`),
    one after another, chunk ``v`` being the ``v``-th of every stage's around the ring; with
    equal chunks of ``c`` layers, stored position ``s·V·c + v·c + j`` holds layer
    ``(v·P + s)·c + j``. ``virtual=1`` is the identity (contiguous stages)."""
    if layers % stages:
        raise MeshError(f"pipeline: {stages} stages do not divide {layers} layers")
    per_stage = layers // stages
    table, c = chunk_layers(stages, virtual, per_stage), chunk_size(per_stage, virtual)
    r = np.arange(layers)
    s, q = r // per_stage, r % per_stage
    return table[s, q // c, q % c]


def interleaved_items(stages: int, microbatches: int, virtual: int) -> tuple[np.ndarray, np.ndarray]:
    """Each stage's work, in the order it does it (item ``i`` at tick ``stage + i``): the
    micro-batch and the chunk of item ``i``. Micro-batches go round the ring in groups of
    ``P``: group ``g``'s chunk ``v`` of micro-batch ``g·P + r`` is item ``g·V·P + v·P + r``, so
    the last stage finishes chunk ``v`` of a micro-batch the tick before the first stage starts
    its chunk ``v + 1``. With ``V = 1``, item ``i`` is micro-batch ``i``."""
    i = np.arange(microbatches * virtual)
    g, rem = i // (virtual * stages), i % (virtual * stages)
    return g * stages + rem % stages, rem // stages


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
    pick: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None,
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
    are zeros and cut off.

    With ``split.virtual = V > 1`` (the interleaved schedule) ``stacked`` is this stage's block
    of a stack in :func:`stage_order`, ``V`` chunks, and the micro-batches go round the ring of
    stages ``V`` times (``split.microbatches`` a multiple of the stages). ``pick(carry, (block,
    index), rows)`` is ``layer_fn`` on layer ``index`` of ``block``, picked where its
    checkpoint redoes the pick in the backward pass (:func:`zoo.layers.stack.scan_layers`):
    a chunk sliced out at each tick would be saved once per tick."""
    if (cut := _CUT.get()) is not None and not cut.whole:  # the 1F1B schedule runs the stack itself
        return cut.stack(AtStack(layer_fn, carry, stacked, rows, split, n_layers, combine, pick))
    stages, m, virtual = split.stages, split.microbatches, split.virtual
    leaves = jax.tree.leaves(carry)
    if not leaves:
        raise MeshError("pipeline: a pipelined stack needs a carry (the residual stream)")
    n_rows = leaves[0].shape[0]
    if n_rows % m:
        raise MeshError(
            f"pipeline: microbatches={m} must divide each device's {n_rows} rows (the batch over its batch axes)"
        )
    per_stage = jax.tree.leaves(stacked)[0].shape[0]
    if virtual > 1 and (m % stages or not virtual_fits(per_stage, virtual)):
        raise MeshError(
            f"pipeline: the interleaved schedule (virtual_stages={virtual}) needs microbatches ({m}) a multiple of "
            f"the {stages} stages and each stage's {per_stage} layers in virtual_stages chunks, none empty "
            f"(possible: {virtual_options(per_stage)})"
        )
    chunk = chunk_size(per_stage, virtual)
    layer_at = jnp.asarray(chunk_layers(stages, virtual, per_stage), jnp.int32)  # [P, V, chunk]
    stage = jax.lax.axis_index(PIPELINE)
    micro = _split_rows(carry, m, n_rows, "carry")
    micro_rows = _split_rows(rows, m, n_rows, "row input")
    item_batch, item_chunk = (jnp.asarray(a, jnp.int32) for a in interleaved_items(stages, m, virtual))

    def run_chunk(c, r, v):
        """This stage's chunk ``v`` on one micro-batch; padding layers (past ``n_layers``) skipped."""

        def one(c, layer_j):
            layer, j = layer_j
            at, real = chunk_place(layer_at, per_stage, n_layers, stage, v, j)
            if virtual == 1:
                new, out = layer_fn(c, layer, r)
            elif pick is not None:
                new, out = pick(c, (stacked, at), r)
            else:
                layer = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, at, keepdims=False), stacked)
                new, out = layer_fn(c, layer, r)
            return jax.tree.map(lambda a, b: jnp.where(real, a, b), new, c), out

        return jax.lax.scan(one, c, (stacked if virtual == 1 else None, jnp.arange(chunk)))

    # The hand-over buffer and the last stage's outputs vary over the pipeline axis (ppermute
    # and the stage index make them differ) as well as over whatever the rows vary over.
    kinds = jax.tree.map(lambda x: varying_axes(x) | {PIPELINE}, micro)
    # The micro-batches, read by the first stage at every tick, typed as varying over the
    # stages here, once: the transpose of that cast (a psum of their gradient over the stages)
    # then runs once after the loop, not on every tick's whole [M, ...] gradient inside it.
    micro = jax.tree.map(_typed_like, micro, kinds)
    first = jax.tree.map(lambda x, k: _typed_like(jnp.zeros_like(x[0]), k), micro, kinds)
    outputs = jax.tree.map(lambda x, k: _typed_like(jnp.zeros_like(x), k), micro, kinds)
    # Forward to the next stage; interleaved, the last stage's output goes round to the first.
    ring = [(i, (i + 1) % stages) for i in range(stages if virtual > 1 else stages - 1)]

    def tick(state, t):
        received, outputs = state
        i = t - stage  # the item this stage works on at tick t
        active = (i >= 0) & (i < m * virtual)
        i = jnp.clip(i, 0, m * virtual - 1)
        mb, v = item_batch[i], item_chunk[i]
        fed = jax.tree.map(lambda x: x[mb], micro)
        inputs = jax.tree.map(lambda a, b: jnp.where((stage == 0) & (v == 0), a, b), fed, received)
        with on_microbatch(mb):
            y, outs = run_chunk(inputs, jax.tree.map(lambda x: x[mb], micro_rows), v)
        keep = active & (stage == stages - 1) & (v == virtual - 1)
        outputs = jax.tree.map(
            lambda o, new: jax.lax.dynamic_update_index_in_dim(o, jnp.where(keep, new, o[mb]), mb, 0), outputs, y
        )
        sent = jax.tree.map(lambda x: jax.lax.ppermute(x, PIPELINE, ring), y)
        return (sent, outputs), outs

    (_, outputs), per_tick = jax.lax.scan(tick, (first, outputs), jnp.arange(m * virtual + stages - 1))
    last = stage == stages - 1
    whole = jax.tree.map(lambda o: jax.lax.psum(jnp.where(last, o, jnp.zeros_like(o)), PIPELINE), outputs)
    carry_out = jax.tree.map(lambda o: o.reshape(n_rows, *o.shape[2:]), whole)
    return carry_out, _gather_outputs(per_tick, _combine_kinds(combine, per_tick), stage, split, per_stage, n_layers)


def _gather_outputs(per_tick: PyTree, kinds: PyTree, stage, split: PipelineSplit, per_stage: int, n_layers: int):
    """The per-layer outputs of every stage's layers, ``[n_layers, ...]`` on every stage (in
    layer order), from this stage's per-tick outputs ``[ticks, chunk, ...]``: stage ``s`` did
    item ``i`` (:func:`interleaved_items`) at tick ``s + i``; padding layers' outputs zeroed and cut off."""
    stages, m, virtual = split.stages, split.microbatches, split.virtual
    item_batch, item_chunk = interleaved_items(stages, m, virtual)
    by_chunk = np.zeros((virtual, m), np.int64)  # [v, micro-batch] -> item
    by_chunk[item_chunk, item_batch] = np.arange(m * virtual)
    chunk = chunk_size(per_stage, virtual)
    layer = jnp.asarray(chunk_layers(stages, virtual, per_stage), jnp.int32)[stage]  # [V, chunk]
    real = (layer >= 0) & (layer < n_layers)
    mine = jnp.arange(stages) == stage

    def one(y, kind):
        y = jax.lax.dynamic_slice_in_dim(y, stage, m * virtual, axis=0)[by_chunk]  # [V, M, chunk, ...]
        if kind == "sum":
            y = jnp.sum(y, axis=1)
        elif kind == "mean":
            y = jnp.mean(y, axis=1)
        else:  # [V, M, chunk, rows/M, ...] -> [V, chunk, rows, ...]
            y = jnp.moveaxis(y, 1, 2)
            y = y.reshape(virtual, chunk, -1, *y.shape[4:])
        y = jnp.where(real.reshape(virtual, chunk, *(1,) * (y.ndim - 2)), y, jnp.zeros_like(y))
        # Each stage's chunks in their places ([V, P, chunk]: layer order), the others zeros; a
        # psum (not an all-gather) so the result is typed the same on every stage, as what
        # follows the stack must be.
        full = jnp.where(mine.reshape(1, -1, *(1,) * (y.ndim - 1)), y[:, None], jnp.zeros_like(y)[:, None])
        full = jax.lax.psum(full.reshape(virtual * stages * chunk, *y.shape[2:]), PIPELINE)
        return in_layer_order(full, stages, virtual, per_stage, n_layers)

    return jax.tree.map(one, per_tick, kinds)


@dataclasses.dataclass(frozen=True)
class AtStack:
    """What a loss passes to its pipelined stack (:func:`pipelined_scan`'s arguments): the
    checkpointed layer body ``layer_fn(carry, layer, rows)``, the residual stream ``carry``,
    this stage's block ``stacked``, the per-row inputs ``rows``, the split, the real layer
    count and how each per-layer output combines over the micro-batches."""

    layer_fn: Callable[[Any, Any, Any], tuple[Any, Any]]
    carry: PyTree
    stacked: PyTree
    rows: PyTree
    split: PipelineSplit
    n_layers: int
    combine: PyTree = None
    # ``pick(carry, (block, index), rows)``: ``layer_fn`` on layer ``index`` of the block, picked
    # inside the layer's checkpoint (the interleaved schedules run a chunk a tick picks).
    pick: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None

    def out_shapes(self) -> PyTree:
        """One layer's per-layer outputs on the whole carry (shapes and types)."""
        one = jax.tree.map(lambda w: w[0], self.stacked)
        return jax.eval_shape(lambda: self.layer_fn(self.carry, one, self.rows)[1])

    def out_kinds(self) -> PyTree:
        """Per leaf of the per-layer outputs, ``"sum"``, ``"mean"`` or ``"rows"`` (:func:`pipelined_scan`)."""
        return _combine_kinds(self.combine, self.out_shapes())


class StackReached(Exception):  # control flow, not an error
    """Raised by a :class:`StackCut` with ``stop``: the loss was traced up to its stack."""


class StackCut:
    """A loss traced cut at its pipelined stack (:func:`split_at_stack`). ``record``: the stack's
    call is kept in :attr:`at` and the stack returns its input unchanged (and zero per-layer
    outputs; with ``stop``, :class:`StackReached` is raised instead), every :func:`batch_total` is
    recorded in :attr:`totals` (the whole batch's denominators) and the :func:`stack_total` calls
    are counted in :attr:`asked`; ``whole``: the loss runs on the whole batch, its stack as
    :func:`pipelined_scan` runs it (GPipe's forward pass), and every :func:`stack_total` is
    recorded in :attr:`stack_totals`; otherwise the stack returns ``output`` (its output carry
    and per-layer outputs) and each :func:`batch_total` and :func:`stack_total` the recorded
    value of the same call."""

    def __init__(self, *, record: bool = False, output: PyTree = None, totals: tuple[Array, ...] = (),
                 stack_totals: tuple[Array, ...] = (), stop: bool = False, whole: bool = False):  # fmt: skip
        self.record, self.output, self.stop, self.whole = record, output, stop, whole
        self.at: AtStack | None = None
        self.out_shapes: PyTree = None  # recorded: one layer's per-layer outputs, and how each combines
        self.out_kinds: PyTree = None
        self.totals: list[Array] = list(totals)
        self.stack_totals: list[Array] = list(stack_totals)
        self.calls = self.used = self.asked = self.stack_used = 0

    def stack(self, at: AtStack) -> tuple[PyTree, PyTree]:
        if self.calls:
            raise MeshError(
                "schedule='1f1b': the loss runs more than one pipelined layer stack (a model with several "
                "stacks pipelined, such as DeepSeek-V3's dense and MoE layers, runs on schedule='gpipe')"
            )
        self.calls += 1
        if self.record and self.stop:  # what follows the stack is not traced at all
            self.at = at
            raise StackReached
        if self.record:
            self.at, self.out_shapes, self.out_kinds = at, at.out_shapes(), at.out_kinds()
            zeros = jax.tree.map(lambda s: jnp.zeros((at.n_layers, *s.shape), s.dtype), self.out_shapes)
            return at.carry, zeros
        return self.output

    def total(self, value: Array) -> Array:
        if self.whole:
            return value
        if self.record:
            self.totals.append(value)
            return value
        self.used += 1
        return self._replayed("batch totals (zoo.hooks.pipeline.batch_total)", self.totals, self.used)

    def stack_total(self, value: Array) -> Array:
        if self.whole:
            self.stack_totals.append(value)
            return value
        if self.record:  # the stack did not run: a placeholder, the schedule runs the whole pass
            self.asked += 1
            return value
        self.stack_used += 1
        return self._replayed("stack totals (zoo.hooks.pipeline.stack_total)", self.stack_totals, self.stack_used)

    @staticmethod
    def _replayed(what: str, recorded: list[Array], calls: int) -> Array:
        """The ``calls``-th value recorded on the whole batch, for the same call on a micro-batch."""
        if calls > len(recorded):
            raise MeshError(f"schedule='1f1b': the loss took more {what} on a micro-batch than the {len(recorded)} it "
                            "took on the whole batch")  # fmt: skip
        return recorded[calls - 1]


_CUT: contextvars.ContextVar[StackCut | None] = contextvars.ContextVar("zoo_stack_cut", default=None)
# The name scope of a :func:`stack_total` (zoo.plan.jaxprs.has_scope finds it in a traced step).
STACK_TOTAL = "stack_total"


@contextlib.contextmanager
def split_at_stack(cut: StackCut) -> Iterator[StackCut]:
    """Trace a loss with its pipelined stack cut as ``cut`` says (the 1F1B schedule's way of
    running what precedes and what follows the stack on their own)."""
    token = _CUT.set(cut)
    try:
        yield cut
    finally:
        _CUT.reset(token)


def batch_total(x: Shaped[Array, "*shape"]) -> Shaped[Array, "*shape"]:
    """A total over the whole batch that a loss divides by (the count of its predictions): its
    sum over the devices (:func:`zoo.hooks.global_sum`). Under the 1F1B schedule a micro-batch's
    loss divides by the whole batch's total, recorded on the whole batch before the schedule
    runs, so the micro-batches' losses add up to the batch's and each backward pass gets its
    exact share of the gradient."""
    total = global_sum(x)
    cut = _CUT.get()
    return total if cut is None else cut.total(total)


def stack_total(x: Shaped[Array, "*shape"]) -> Shaped[Array, "*shape"]:
    """A total over the whole batch of what the pipelined stack computes (Qwen3-MoE's expert
    loads, per layer) that a loss uses as a constant: its sum over the devices
    (:func:`zoo.hooks.global_sum`), without gradient. Under the 1F1B schedule a micro-batch's
    loss is traced before the later micro-batches' stack has run, so the schedule runs the
    stack's forward pass over the whole batch first (one forward pass more, nothing saved) and
    each micro-batch's loss takes the total recorded there: a loss linear in its micro-batch's
    terms given these totals adds up to the batch's, and so does its gradient."""
    with jax.named_scope(STACK_TOTAL):  # the planner prices 1F1B's forward pass over the whole batch
        total = jax.lax.stop_gradient(global_sum(x))
    cut = _CUT.get()
    return total if cut is None else cut.stack_total(total)


_LAYOUT: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("zoo_stage_order", default=(1, 1))

# The micro-batch a pipelined stack's layers run on at this point of the trace (a traced index),
# for what must differ between micro-batches that a stage runs with the same weights (LoRA
# dropout's masks: zoo.lora.dropout); ``None`` outside a pipelined stack.
_MICROBATCH: contextvars.ContextVar[Array | None] = contextvars.ContextVar("zoo_microbatch", default=None)


@contextlib.contextmanager
def on_microbatch(index: Int[Array, ""]) -> Iterator[None]:
    """Within it, :func:`microbatch` is ``index`` (set by the schedules around a chunk's layers)."""
    token = _MICROBATCH.set(index)
    try:
        yield
    finally:
        _MICROBATCH.reset(token)


def microbatch() -> Int[Array, ""] | None:
    """The micro-batch a pipelined stack's layers run on here (``None`` outside one)."""
    return _MICROBATCH.get()


@contextlib.contextmanager
def stacks_in_stage_order(stages: int, virtual: int) -> Iterator[None]:
    """Code that updates a placed model's pipelined stacks from per-layer values (a family's
    ``after_step``) runs under this where the stacks are in :func:`stage_order` (``zoo.train``
    with ``virtual_stages``): :func:`per_layer_to_stored` then lays the values out as they are."""
    token = _LAYOUT.set((stages, virtual))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def stage_layout() -> tuple[int, int]:
    """``(stages, virtual)`` of the innermost :func:`stacks_in_stage_order`; ``(1, 1)`` outside one."""
    return _LAYOUT.get()


def per_layer_to_stored(values: Shaped[Array, "n *rest"], length: int) -> Shaped[Array, "L *rest"]:
    """Per-layer values ``[n, ...]`` in layer order (a pipelined step's per-layer outputs) laid
    out like a stored stack of ``length`` layers: zeros for its padding layers, and in stage
    order under :func:`stacks_in_stage_order`."""
    values = jnp.pad(values, [(0, length - values.shape[0])] + [(0, 0)] * (values.ndim - 1))
    stages, virtual = _LAYOUT.get()
    return values if virtual == 1 else values[stage_order(length, stages, virtual)]
