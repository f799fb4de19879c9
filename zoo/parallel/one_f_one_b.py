"""The 1F1B pipeline schedule: each micro-batch's backward pass starts as soon as its forward
pass leaves the last stage, so a stage keeps the saved tensors of a bounded number of
micro-batches, however many there are.

GPipe (:func:`zoo.hooks.pipeline.pipelined_scan`) runs the stack's forward pass as one loop and
lets autodiff make the backward pass: every stage keeps all ``M`` micro-batches' saved tensors
until the backward pass starts. Here the step runs the backward pass itself, in the same tick
loop as the forward pass:

1. the loss is traced once on the device's rows up to its pipelined stack, for the stage's block
   (``jax.vjp``: its gradient goes back to the parameters it is made of) and the whole batch's
   loss denominators (:func:`zoo.hooks.pipeline.batch_total`); the rest of that trace is dead
   code, which jit removes;
2. ``V·M + V·P + P - 2`` ticks in three loops (``V·P - 1`` warm-up ticks of forward passes,
   then both, then ``V·P - 1`` cool-down ticks of backward passes; ``V = 1``: ``P - 1``, ``M``,
   ``P - 1``). When the first stage starts a micro-batch, every stage runs what precedes the
   stack on it (the embedding, DeepSeek-V3's dense first layers) under ``jax.vjp``, keeping its
   residuals and the per-row inputs in a ring of ``2P`` micro-batches. At tick ``t`` stage ``s``
   runs the forward pass of its item ``t - s`` (a micro-batch's chunk) with ``jax.vjp``, keeping
   what its backward pass needs (the placement map's saved tensors) in a ring of ``2VP - 1``
   slots, and the backward pass of an item from its slot. The last stage's output goes to every
   stage (a ``psum`` of one non-zero term), which runs the loss's tail on that micro-batch (the
   final norm, head and loss, divided by the whole batch's counts; DeepSeek-V3's MTP block) and
   its ``jax.vjp``: the tail's gradients are accumulated and the cotangent starts the
   micro-batch's backward pass on the last stage in the same tick. Forward activations go one
   stage on and cotangents one stage back by ``ppermute`` at every tick; when the first stage
   ends a micro-batch, the cotangent of its input goes back through what precedes the stack;
3. the stage's weights' gradient goes back through step 1's ``jax.vjp``.

A hand-over takes a tick each way, so micro-batch ``i`` waits on stage ``s`` from tick ``i + s`` to
tick ``i + 2(P - 1) - s``: stage ``s`` keeps at most ``2(P - s) - 1`` micro-batches' saved tensors
(``2P - 1`` on the first: the ring's size, whatever ``M``). Megatron-LM's 1F1B, whose stages run
unsynchronised, keeps ``P - s``; a tick here runs a forward and a backward pass on every stage in
lockstep, which gives GPipe's bubble, ``(P - 1) / (M + P - 1)``, without its memory. Numerics
are GPipe's: the loss and every gradient equal one device's.

Per-layer outputs (router statistics) wait on each stage from a micro-batch's forward pass to
its tail, where the stages' are put together as over one micro-batch (a mean's share is 1/M of
it), and the gradient of the floating ones waits from the tail to the stage's backward pass; the
loss must be a sum over micro-batches of their tails (a loss that divides by a count over the
batch takes it from :func:`zoo.hooks.pipeline.batch_total`, recorded on the whole batch first).
DeepSeek-V3's (next-token, MTP and sequence-wise balance losses) is. Qwen3-MoE's Switch balance
loss is a product of two whole-batch sums, but linear in the router probabilities given the
whole batch's expert loads: those (:func:`zoo.hooks.pipeline.stack_total`) come from a forward
pass of the loss over the whole batch, its stack run as GPipe runs it, before the ticks (one
forward pass more, which keeps nothing for the backward pass); then each micro-batch's share is
exact.

Interleaved (``virtual_stages=V``), each stage's layers are ``V`` chunks picked out of its block
inside the layers' checkpoint; the forward items follow GPipe's interleaved order and the
backward items the reverse chunk order, round the ring of stages both ways.

Limits, each refused with a clear error: one pipelined stack per loss (Qwen3-MoE's dense-first
block and MoE block are two).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree

from zoo.core.mesh import PIPELINE
from zoo.errors import MeshError
from zoo.hooks.pipeline import (
    AtStack,
    StackCut,
    StackReached,
    chunk_layers,
    chunk_place,
    chunk_size,
    in_layer_order,
    interleaved_items,
    on_microbatch,
    split_at_stack,
    virtual_fits,
    virtual_options,
)
from zoo.hooks.step import PipelineSplit, varying_axes

LossOf = Callable[[PyTree, PyTree], tuple[Float[Array, ""], Any]]


def ring_slots(stages: int, microbatches: int, virtual: int = 1) -> int:
    """How many (micro-batch, chunk) pairs' saved tensors a stage keeps at most: ``2·V·P - 1``
    (the first stage's), or all ``V·M`` where fewer. A chunk is ``1/V`` of the stage's layers."""
    return min(virtual * microbatches, 2 * virtual * stages - 1)


def _orders(stages: int, microbatches: int, virtual: int) -> tuple[np.ndarray, ...]:
    """A stage's forward items (item ``i`` at tick ``s + i``): micro-batch and chunk, in the
    interleaved schedule's order (:func:`zoo.hooks.pipeline.interleaved_items`: groups of ``P``
    micro-batches, each group's chunks in turn); and its backward items (item ``j`` at tick
    ``V·P - 1 + j + (P - 1 - s)``): micro-batch, chunk (the last chunk first) and the forward item
    of the same pair."""
    fwd_mb, fwd_chunk = interleaved_items(stages, microbatches, virtual)
    j = np.arange(microbatches * virtual)
    g, rem = j // (virtual * stages), j % (virtual * stages)
    bwd_chunk = virtual - 1 - rem // stages
    bwd_mb = g * stages + rem % stages
    return fwd_mb, fwd_chunk, bwd_mb, bwd_chunk, g * virtual * stages + bwd_chunk * stages + rem % stages


def _vary(x: Array, axes: frozenset[str]) -> Array:
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _zeros_like(x: Array) -> Array:
    """Zeros of ``x``'s shape and dtype, varying over the mesh axes ``x`` varies over."""
    return _vary(jnp.zeros(x.shape, x.dtype), varying_axes(x))


def _zeros_of(s: jax.ShapeDtypeStruct, lead: tuple[int, ...] = (), extra: frozenset[str] | set[str] = frozenset()) -> Array:
    """Zeros of an abstract value's shape (after ``lead``) and dtype, varying over the mesh axes it
    varies over and ``extra``."""
    axes = getattr(getattr(s, "manual_axis_type", None), "varying", None) or frozenset()
    return _vary(jnp.zeros((*lead, *s.shape), s.dtype), frozenset(axes) | frozenset(extra))


def _cut_rows(tree: PyTree, m: int) -> PyTree:
    def cut(x):
        if x.ndim == 0 or x.shape[0] % m:
            raise MeshError(
                f"schedule='1f1b': microbatches={m} must divide each device's rows; got an array of shape {tuple(x.shape)}"
            )
        return x.reshape(m, x.shape[0] // m, *x.shape[1:])

    return jax.tree.map(cut, tree)


def _at(tree: PyTree, i: Array | int) -> PyTree:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _kept_vjp(fn: Callable[..., Any], what: str) -> tuple[Callable[..., Any], Callable[..., Any], dict[str, Any]]:
    """``fn(diff, given, *rest) -> (out, aux)`` split into a forward pass ``(diff, again, given,
    *rest) -> (out, aux, kept)`` and a backward pass ``(kept, diff, again, given, cotangent) -> d
    diff``: of the residuals its ``jax.vjp`` at ``diff`` keeps, those that are leaves of ``given``
    or leaves of ``diff`` that ``again`` marks (the stage's weights, the parameters, the rows: given
    again to the backward pass) are not ``kept``. Both are jitted, traced once: the residuals a
    trace keeps depend on what it sees outside, here its arguments alone, so every call keeps the
    same (``layout``: how to rebuild the backward pass; ``spaces``: the memory each kept residual
    is in, host for an offloaded name)."""
    layout: dict[str, Any] = {}

    def sources(diff, again, given):
        flat = [x for x, a in zip(jax.tree.leaves(diff), again) if a] + jax.tree.leaves(given)
        return flat

    @functools.partial(jax.jit, static_argnums=1)
    def forward(diff, again, given, *rest):
        out, back, aux = jax.vjp(lambda d: fn(d, given, *rest), diff, has_aux=True)
        res, res_def = jax.tree.flatten(back)
        ids = {id(x): k for k, x in enumerate(sources(diff, again, given))}
        where = tuple(ids.get(id(x)) for x in res)
        kept = [x for x, k in zip(res, where) if k is None]
        if layout.setdefault("back", (res_def, where)) != (res_def, where):
            raise MeshError(f"schedule='1f1b': {what} kept other residuals at another trace")
        layout["spaces"] = [getattr(jax.typeof(x), "memory_space", None) for x in kept]
        return out, aux, kept

    @functools.partial(jax.jit, static_argnums=2)
    def backward(kept, diff, again, given, g):
        res_def, where = layout["back"]
        kept, known = iter(kept), sources(diff, again, given)
        return jax.tree.unflatten(res_def, [next(kept) if k is None else known[k] for k in where])(g)[0]

    return forward, backward, layout


def value_and_grad(loss_of: LossOf, params: PyTree, batch: PyTree, split: PipelineSplit) -> tuple[Any, PyTree]:
    """``((loss, aux), grads)`` of ``loss_of(params, batch)`` on the 1F1B schedule, inside the
    parallel step's ``shard_map``: ``params`` the arrays to differentiate (a pytree), ``batch``
    this device's rows (every leaf leads with them). ``aux`` is summed over the micro-batches
    (a metric must be a sum over the batch, or a mean over its :func:`batch_total`)."""
    stages, m, virtual = split.stages, split.microbatches, split.virtual
    stage = jax.lax.axis_index(PIPELINE)
    last = stages - 1
    leaves, treedef = jax.tree.flatten(params)
    found: dict[str, Any] = {}

    # 1. The stack's block and the batch's denominators: the loss traced on the whole batch up to
    # its stack (the rest of that trace is dead code, which jit removes).
    def stack_of(flat):
        with split_at_stack(StackCut(record=True)) as cut:
            loss_of(jax.tree.unflatten(treedef, flat), batch)
        if cut.at is None:
            raise MeshError("schedule='1f1b': the loss ran no pipelined layer stack (a mesh with a pipeline axis)")
        at: AtStack = cut.at
        ids = {id(x) for x in jax.tree.leaves(at.stacked)}
        found["at"], found["in_stack"] = at, [id(x) in ids for x in flat]
        found["out_shapes"], found["out_kinds"] = cut.out_shapes, cut.out_kinds
        found["rows"] = jax.tree.leaves(at.carry)[0].shape[0]
        found["asked"] = cut.asked
        return at.stacked, tuple(cut.totals)

    stacked, stack_vjp, totals = jax.vjp(stack_of, leaves, has_aux=True)
    at, in_stack = found["at"], found["in_stack"]
    stack_totals: tuple[Array, ...] = ()
    if found["asked"]:  # totals of what the stack computes: its forward pass over the whole batch first
        with split_at_stack(StackCut(whole=True)) as whole:
            loss_of(jax.tree.unflatten(treedef, [jax.lax.stop_gradient(x) for x in leaves]), batch)
        stack_totals = tuple(whole.stack_totals)
    rest_leaves = [x for x, s in zip(leaves, in_stack) if not s]
    if found["rows"] % m:
        raise MeshError(f"schedule='1f1b': microbatches={m} must divide each device's {found['rows']} rows")
    batch_mb = _cut_rows(batch, m)

    def merged(rest):
        rest = iter(rest)
        return jax.tree.unflatten(treedef, [x if s else next(rest) for x, s in zip(leaves, in_stack)])

    def head(rest, rows):
        """What precedes the stack (the embedding, DeepSeek-V3's dense first layers) on one
        micro-batch (``rows``: its rows of the batch): the stack's input and, as ``aux``, the
        per-row inputs."""
        try:
            with split_at_stack(StackCut(record=True, stop=True)) as cut:
                loss_of(merged(rest), rows)
        except StackReached:
            return cut.at.carry, cut.at.rows
        raise MeshError("schedule='1f1b': the loss ran no pipelined layer stack on a micro-batch")

    # Run at the tick the first stage starts a micro-batch, on every stage; its backward pass at
    # the tick the first stage ends it, its residuals waiting in a ring of micro-batches.
    head_vjp, head_back, head_layout = _kept_vjp(head, "the loss before its stack")
    again_rest = (True,) * len(rest_leaves)  # the parameters are given to the backward pass again
    per_stage = jax.tree.leaves(stacked)[0].shape[0]
    if virtual > 1 and (m % stages or not virtual_fits(per_stage, virtual) or at.pick is None):
        raise MeshError(
            f"schedule='1f1b' with virtual_stages={virtual} (interleaved 1F1B) needs microbatches ({m}) a multiple of "
            f"the {stages} stages and each stage's {per_stage} layers in virtual_stages chunks, none empty "
            f"(possible: {virtual_options(per_stage)})"
        )
    chunk = chunk_size(per_stage, virtual)
    layer_at = jnp.asarray(chunk_layers(stages, virtual, per_stage), jnp.int32)  # [P, V, chunk]
    items = virtual * m  # (micro-batch, chunk) pairs a stage runs forward and backward
    fwd_mb, fwd_chunk, bwd_mb, bwd_chunk, bwd_item = (jnp.asarray(a, jnp.int32) for a in _orders(stages, m, virtual))
    # Per-layer outputs (router statistics): each stage's, for the layers it runs, wait from the
    # micro-batch's forward pass to its tail, where the stages' are put together; the gradient of
    # the floating ones waits from the tail to the stage's backward pass. Integers are counts.
    kinds = jax.tree.leaves(found["out_kinds"])
    out_def = jax.tree.structure(found["out_shapes"])

    def floating(leaf) -> bool:
        return jnp.issubdtype(leaf.dtype, jnp.inexact)

    def forward(block, h, r, stage, v, mb):
        """This stage's chunk ``v`` of layers on one micro-batch, and their per-layer outputs
        ``[chunk, ...]`` as (floating, other) leaves; padding layers (past the real count)
        skipped, their outputs zero. Interleaved, each layer is picked out of the block inside its
        checkpoint (a chunk sliced out would be a residual: the chunk's weights in every slot)."""

        def one(c, layer_j):
            layer, j = layer_j
            place, real = chunk_place(layer_at, per_stage, at.n_layers, stage, v, j)  # past a short chunk: skipped
            if virtual == 1:
                new, out = at.layer_fn(c, layer, r)
            else:
                new, out = at.pick(c, (block, place), r)
            out = [jnp.where(real, o, jnp.zeros_like(o)) for o in jax.tree.leaves(out)]
            return jax.tree.map(lambda a, b: jnp.where(real, a, b), new, c), out

        with on_microbatch(mb):  # (what differs by micro-batch with one weight: LoRA dropout's masks)
            y, outs = jax.lax.scan(one, h, (block if virtual == 1 else None, jnp.arange(chunk)))
        return (y, [o for o in outs if floating(o)]), [o for o in outs if not floating(o)]

    def layers(diff, r, stage, v, mb):
        block, h = diff
        return forward(block, h, r, stage, v, mb)

    forward_vjp, backward, layout = _kept_vjp(layers, "the stage's forward pass")

    def per_layer(outs, counts):
        """The whole stack's per-layer outputs ``[n_layers, ...]`` from every stage's chunks'
        (``[V, chunk, ...]`` each, on its own stage), combined as over one micro-batch of the
        ``M``: a mean's share is ``1/M`` of it. Chunk ``v`` of stage ``s`` is layers ``(v·P + s)·chunk``..."""
        outs, counts, leaves_ = iter(outs), iter(counts), []
        for kind, shape in zip(kinds, jax.tree.leaves(found["out_shapes"])):
            mine = next(outs) if jnp.issubdtype(shape.dtype, jnp.inexact) else next(counts)  # [V, chunk, ...]
            full = jnp.zeros((virtual, stages, *mine.shape[1:]), mine.dtype)
            full = jax.lax.dynamic_update_index_in_dim(_vary(full, varying_axes(mine)), mine, stage, 1)
            full = jax.lax.psum(full, PIPELINE).reshape(virtual * stages * chunk, *mine.shape[2:])
            full = in_layer_order(full, stages, virtual, per_stage, at.n_layers)
            leaves_.append(full / m if kind == "mean" else full)
        return jax.tree.unflatten(out_def, leaves_)

    def tail(rest, y_local, outs_local, counts_local, i):
        """The loss after the stack on micro-batch ``i``, from the last stage's ``y_local`` (sent
        to every stage) and every stage's per-layer outputs; ``(loss, aux)`` with the whole
        batch's denominators."""
        y = jax.tree.map(lambda a: jax.lax.psum(jnp.where(stage == last, a, jnp.zeros_like(a)), PIPELINE), y_local)
        rest = iter(rest)
        flat = [x if s else next(rest) for x, s in zip(leaves, in_stack)]
        output = (y, per_layer(outs_local, counts_local))
        with split_at_stack(StackCut(output=output, totals=totals, stack_totals=stack_totals)) as cut:
            out = loss_of(jax.tree.unflatten(treedef, flat), _at(batch_mb, i))
        if (cut.used, cut.stack_used) != (len(totals), len(stack_totals)):
            raise MeshError(
                f"schedule='1f1b': the loss took {cut.used} batch totals and {cut.stack_used} stack totals on a "
                f"micro-batch, {len(totals)} and {len(stack_totals)} on the batch"
            )
        return out

    # The rings' shapes, from the passes' traces (shapes and types only).
    zero = _vary(jnp.zeros((), jnp.int32), frozenset({PIPELINE}))  # a chunk index, as a tick computes it
    x_shape, row_shapes, head_shapes = jax.eval_shape(lambda: head_vjp(rest_leaves, again_rest, _at(batch_mb, 0)))

    def like(s, lead: tuple[int, ...] = ()) -> Array:
        return _zeros_of(s, lead, {PIPELINE})

    # The stage's weights are given to the backward pass again, its input is kept.
    again = (True,) * len(jax.tree.leaves(stacked)) + (False,) * len(jax.tree.leaves(x_shape))
    (y_shape, out_shapes), count_shapes, kept_shapes = jax.eval_shape(
        lambda: forward_vjp((stacked, jax.tree.map(like, x_shape)), again, jax.tree.map(like, row_shapes), stage, zero, zero)
    )
    slots = ring_slots(stages, m, virtual)
    waits = min(m, 2 * stages)  # micro-batches whose head's residuals, rows or per-layer gradients a stage holds

    def ring_of(shapes, spaces, n, by_stage=True):
        """Zeros for ``n`` slots of each of ``shapes``, in the memory each is in (host: offloaded);
        ``by_stage``: typed as varying over the pipeline (the values differ by stage)."""
        out = [_zeros_of(s, (n,), {PIPELINE} if by_stage else set()) for s in shapes]
        return [jax.device_put(r, sp) if sp == jax.memory.Space.Host else r for r, sp in zip(out, spaces)]

    # A slot more than the ring's: a stage with no forward pass at a tick writes there. (Written
    # unconditionally, an offloaded tensor's slot stays in host memory: no select between the
    # host and the device.)
    ring = ring_of(kept_shapes, layout["spaces"], slots + 1)
    # Interleaved, the last stage hands a micro-batch's chunk on to the first (and its gradient back).
    up = [(i, (i + 1) % stages) for i in range(stages if virtual > 1 else last)]
    down = [((i + 1) % stages, i) for i in range(stages if virtual > 1 else last)]

    def all_chunks(s) -> Array:  # a per-layer output's placeholder for every chunk of the stage
        return like(s, (virtual,))

    _, aux_shape = jax.eval_shape(lambda: tail(rest_leaves, jax.tree.map(like, y_shape), [all_chunks(s) for s in out_shapes],
                                               [all_chunks(s) for s in count_shapes], 0))  # fmt: skip
    # The stack input's cotangent is summed over the stages from the first stage's (typed as the input).
    x_axes = frozenset(getattr(getattr(jax.tree.leaves(x_shape)[0], "manual_axis_type", None), "varying", None) or ())

    state = {
        "fwd": jax.tree.map(like, y_shape),  # what the previous stage handed over
        "bwd": jax.tree.map(like, y_shape),  # the cotangent the next stage handed back
        "ring": ring,
        # The head's residuals, by micro-batch: every stage runs the same head, so they are typed as
        # the head keeps them (a residual read back varying over the pipeline gave its custom VJP a
        # cotangent of another type, which jax 0.12.1 refuses).
        "head": ring_of(head_shapes, head_layout["spaces"], waits, by_stage=False),
        "rows": [like(s, (waits,)) for s in jax.tree.leaves(row_shapes)],  # the per-row inputs, by micro-batch
        "outs": [like(s, (slots + 1,)) for s in out_shapes],  # per-layer outputs awaiting the tail
        "counts": [like(s, (slots + 1,)) for s in count_shapes],
        "d_outs": [like(s, (waits, virtual)) for s in out_shapes],  # their gradients awaiting the backward pass
        # (the block's floating leaves: a quantized base's integer codes have no gradient)
        "g_block": [_zeros_like(x) for x in jax.tree.leaves(stacked) if _inexact(x)],
        "g_rest": [_zeros_like(x) for x in rest_leaves],
        "loss": jnp.zeros((), jnp.float32),
        "aux": jax.tree.map(_zeros_of, aux_shape),
    }
    row_def = jax.tree.structure(row_shapes)

    def put_all(buffers, values, at_):
        return [jax.lax.dynamic_update_index_in_dim(b, v, at_, 0) for b, v in zip(buffers, values)]

    def get_all(buffers, at_):
        return [jax.lax.dynamic_index_in_dim(b, at_, keepdims=False) for b in buffers]

    def rows_of(state, mb):
        return jax.tree.unflatten(row_def, get_all(state["rows"], mb % waits))

    def run_head(state, t):
        """The head of the micro-batch the first stage starts at tick ``t``, on every stage: its
        residuals and rows kept; returns the stack's input (the first stage's) and the state."""
        i = fwd_mb[jnp.clip(t, 0, items - 1)]
        x, rows, kept = head_vjp(rest_leaves, again_rest, _at(batch_mb, i))
        state = dict(state)
        state["head"] = put_all(state["head"], kept, i % waits)
        typed = [_vary(r, varying_axes(r) | {PIPELINE}) for r in jax.tree.leaves(rows)]
        state["rows"] = put_all(state["rows"], typed, i % waits)
        return jax.tree.map(lambda a: _vary(a, varying_axes(a) | {PIPELINE}), x), state

    def run_head_back(state, t, dh):
        """The head's backward pass of the micro-batch the first stage ends at tick ``t``, on every
        stage, from the first stage's cotangent ``dh`` of its output."""
        i = bwd_mb[jnp.clip(t - (virtual * stages - 1) - last, 0, items - 1)]
        dx = jax.tree.map(lambda d: jax.lax.psum(jnp.where(stage == 0, d, jnp.zeros_like(d)),
                                                 tuple(sorted(varying_axes(d) - x_axes))), dh)  # fmt: skip
        g_rest = head_back(get_all(state["head"], i % waits), rest_leaves, again_rest, _at(batch_mb, i), dx)
        state = dict(state)
        state["g_rest"] = [a + g for a, g in zip(state["g_rest"], g_rest)]
        return state

    def run_tail(state, y, t):
        """The tail of the micro-batch whose last chunk leaves the last stage at tick ``t``: its
        loss and metrics added up, the gradients of what follows the stack too; returns the
        cotangent of its output (for the last stage's backward pass) and the state."""
        j = jnp.clip(t - last, 0, items - 1)  # the last stage's forward item
        i = fwd_mb[j]
        first = i // stages * virtual * stages + i % stages  # the forward item of the micro-batch's chunk 0
        mine = [jnp.stack([jax.lax.dynamic_index_in_dim(b, (first + v * stages) % slots, keepdims=False)
                           for v in range(virtual)]) for b in state["outs"]]  # fmt: skip
        counts = [jnp.stack([jax.lax.dynamic_index_in_dim(b, (first + v * stages) % slots, keepdims=False)
                             for v in range(virtual)]) for b in state["counts"]]  # fmt: skip
        loss, tail_vjp, aux = jax.vjp(lambda rest, yl, o: tail(rest, yl, o, counts, i), rest_leaves, y, mine,
                                      has_aux=True)  # fmt: skip
        g_rest, dy, d_outs = tail_vjp(_vary(jnp.ones((), loss.dtype), varying_axes(loss)))
        state = dict(state)
        state["d_outs"] = put_all(state["d_outs"], d_outs, i % waits)
        state["g_rest"] = [a + g for a, g in zip(state["g_rest"], g_rest)]
        state["loss"] = state["loss"] + loss
        state["aux"] = jax.tree.map(jnp.add, state["aux"], aux)
        return dy, state

    def when(flag, fn, state, *args):
        """``fn(state, *args) -> (value, state)`` where ``flag`` (the same on every device), else
        zeros and the state unchanged."""
        shapes = jax.eval_shape(lambda: fn(state, *args)[0])
        return jax.lax.cond(flag, lambda s: fn(s, *args), lambda s: (jax.tree.map(_zeros_of, shapes), s), state)

    def tick(state, t, *, fwd: bool, bwd: bool):
        state = dict(state)
        dy = None
        if fwd:
            starts = (t < items) & (fwd_chunk[jnp.clip(t, 0, items - 1)] == 0)  # the first stage starts a micro-batch
            x, state = when(starts, run_head, state, t)
            i = t - stage
            on = (i >= 0) & (i < items)
            i = jnp.clip(i, 0, items - 1)
            mb, v = fwd_mb[i], fwd_chunk[i]
            h = jax.tree.map(lambda a, b: jnp.where((stage == 0) & (v == 0), a, b), x, state["fwd"])
            r = rows_of(state, mb)
            (y, outs), counts, kept = forward_vjp((stacked, h), again, r, stage, v, mb)
            slot = jnp.where(on, i % slots, slots)
            state["ring"] = put_all(state["ring"], kept, slot)
            state["outs"] = put_all(state["outs"], outs, slot)
            state["counts"] = put_all(state["counts"], counts, slot)
            state["fwd"] = jax.tree.map(lambda a: jax.lax.ppermute(a, PIPELINE, up), y)
            if bwd:  # the steady ticks: a micro-batch may leave the last stage now
                if virtual == 1:
                    dy, state = run_tail(state, y, t)
                else:  # only where the last stage ran a micro-batch's last chunk (the same on every device)
                    done = fwd_chunk[jnp.clip(t - last, 0, items - 1)] == virtual - 1
                    dy, state = when(done, run_tail, state, y, t)
        if bwd:
            k = t - (virtual * stages - 1) - (last - stage)
            on = (k >= 0) & (k < items)
            k = jnp.clip(k, 0, items - 1)
            mb, v, item = bwd_mb[k], bwd_chunk[k], bwd_item[k]
            from_tail = (stage == last) & (v == virtual - 1)
            g = state["bwd"] if dy is None else jax.tree.map(lambda a, b: jnp.where(from_tail, a, b), dy, state["bwd"])
            d_outs = [jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(b, mb % waits, keepdims=False), v,
                                                   keepdims=False) for b in state["d_outs"]]  # fmt: skip
            r = rows_of(state, mb)
            # (The stage's input is a kept residual: ``state["bwd"]`` only stands in for its shape.)
            g_block, dh = backward(get_all(state["ring"], item % slots), (stacked, state["bwd"]), again, r, (g, d_outs))
            g_block = [b for b in jax.tree.leaves(g_block) if _inexact(b)]
            state["g_block"] = [a + jnp.where(on, b, jnp.zeros_like(b)) for a, b in zip(state["g_block"], g_block, strict=True)]
            state["bwd"] = jax.tree.map(lambda a: jax.lax.ppermute(a, PIPELINE, down), dh)
            j0 = t - (virtual * stages - 1) - last  # the first stage's backward item
            ends = (j0 >= 0) & (j0 < items) & (bwd_chunk[jnp.clip(j0, 0, items - 1)] == 0)
            state = jax.lax.cond(ends, lambda s: run_head_back(s, t, dh), lambda s: s, state)
        return state, None

    def loop(state, start, n, **kind):
        if n == 0:
            return state
        return jax.lax.scan(lambda s, t: tick(s, t, **kind), state, start + jnp.arange(n))[0]

    # 2. The ticks: warm-up (forward passes), steady (both), cool-down (backward passes). The last
    # stage starts its first backward pass, micro-batch 0's last chunk, at tick V·P - 1.
    warm = virtual * stages - 1
    state = loop(state, 0, warm, fwd=True, bwd=False)
    state = loop(state, warm, items + last - warm, fwd=True, bwd=True)
    state = loop(state, items + last, warm, fwd=False, bwd=True)

    # 3. The stack's gradient back to the parameters it was made of; the rest's added.
    g_block = iter(state["g_block"])
    (d_stack,) = stack_vjp(jax.tree.map(lambda x: next(g_block) if _inexact(x) else np.zeros(x.shape, jax.dtypes.float0),
                                        stacked))  # fmt: skip
    g_rest = iter(state["g_rest"])
    grads = [d if s else d + next(g_rest) for d, s in zip(d_stack, in_stack)]
    return (state["loss"], state["aux"]), jax.tree.unflatten(treedef, grads)
