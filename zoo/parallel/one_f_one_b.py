"""The 1F1B pipeline schedule: each micro-batch's backward pass starts as soon as its forward
pass leaves the last stage, so a stage keeps the saved tensors of a bounded number of
micro-batches, however many there are.

GPipe (:func:`zoo.hooks.pipeline.pipelined_scan`) runs the stack's forward pass as one loop and
lets autodiff make the backward pass: every stage keeps all ``M`` micro-batches' saved tensors
until the backward pass starts. Here the step runs the backward pass itself, in the same tick
loop as the forward pass:

1. the loss is traced up to its pipelined stack over the device's rows (``jax.vjp``): the
   residual stream entering the stack, the stage's block, the per-row inputs, and the whole
   batch's loss denominators (:func:`zoo.hooks.pipeline.batch_total`);
2. ``M + 2P - 2`` ticks in three loops (``P - 1`` warm-up ticks of forward passes, ``M`` ticks of
   both, ``P - 1`` cool-down ticks of backward passes). At tick ``t`` stage ``s`` runs the
   forward pass of micro-batch ``t - s`` with ``jax.vjp``, keeping what its backward pass needs
   (the placement map's saved tensors) in a ring of ``2P - 1`` slots, and the backward pass of
   micro-batch ``t - 2(P - 1) + s`` from its slot. The last stage's output goes to every stage
   (a ``psum`` of one non-zero term), which runs the loss's tail on that micro-batch (the
   final norm, head and loss, divided by the whole batch's counts) and its ``jax.vjp``: the
   tail's gradients are accumulated and the cotangent starts the micro-batch's backward pass
   on the last stage in the same tick. Forward activations go one stage on and cotangents one
   stage back by ``ppermute`` at every tick;
3. the cotangents of the stack's input, gathered on the first stage, go back through step 1's
   ``jax.vjp``.

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
DeepSeek-V3's (next-token, MTP and sequence-wise balance losses) is; Qwen3-MoE's Switch balance
loss, a product of two whole-batch sums, is not, and refuses (:func:`zoo.hooks.pipeline.per_microbatch`).

Limits, each refused with a clear error: one pipelined stack per loss (Qwen3-MoE's dense-first
block and MoE block are two), ``virtual_stages=1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree

from zoo.core.mesh import PIPELINE
from zoo.errors import MeshError
from zoo.hooks.pipeline import AtStack, StackCut, _schedule, split_at_stack
from zoo.hooks.step import PipelineSplit, sum_to_varying_of, varying_axes

LossOf = Callable[[PyTree, PyTree], tuple[Float[Array, ""], Any]]


def ring_slots(stages: int, microbatches: int, virtual: int = 1) -> int:
    """How many (micro-batch, chunk) pairs' saved tensors a stage keeps at most: ``2·V·P - 1``
    (the first stage's), or all ``V·M`` where fewer. A chunk is ``1/V`` of the stage's layers."""
    return min(virtual * microbatches, 2 * virtual * stages - 1)


def _orders(stages: int, microbatches: int, virtual: int) -> tuple[np.ndarray, ...]:
    """A stage's forward items (item ``i`` at tick ``s + i``): micro-batch and chunk, in the
    interleaved schedule's order (:func:`zoo.hooks.pipeline._schedule`: groups of ``P``
    micro-batches, each group's chunks in turn); and its backward items (item ``j`` at tick
    ``V·P - 1 + j + (P - 1 - s)``): micro-batch, chunk (the last chunk first) and the forward item
    of the same pair."""
    fwd_mb, fwd_chunk = _schedule(stages, microbatches, virtual)
    j = np.arange(microbatches * virtual)
    g, rem = j // (virtual * stages), j % (virtual * stages)
    bwd_chunk = virtual - 1 - rem // stages
    bwd_mb = g * stages + rem % stages
    return fwd_mb, fwd_chunk, bwd_mb, bwd_chunk, g * virtual * stages + bwd_chunk * stages + rem % stages


def _vary(x: Array, axes: frozenset[str]) -> Array:
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


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


def _put(buffer: Array, i: Array | int, value: Array, on: Array | bool) -> Array:
    """``buffer`` with ``value`` written at ``i`` (on its leading axis) where ``on``, in place."""
    old = jax.lax.dynamic_index_in_dim(buffer, i, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(on, value, old), i, 0)


def _at(tree: PyTree, i: Array | int) -> PyTree:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


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

    # 1. The loss up to its stack (and its denominators, on the whole batch).
    def head_of(flat):
        with split_at_stack(StackCut(record=True)) as cut:
            loss_of(jax.tree.unflatten(treedef, flat), batch)
        if cut.at is None:
            raise MeshError("schedule='1f1b': the loss ran no pipelined layer stack (a mesh with a pipeline axis)")
        at: AtStack = cut.at
        ids = {id(x) for x in jax.tree.leaves(at.stacked)}
        found["at"], found["in_stack"] = at, [id(x) in ids for x in flat]
        found["out_shapes"], found["out_kinds"] = cut.out_shapes, cut.out_kinds
        return (at.carry, at.stacked), (at.rows, tuple(cut.totals))

    (carry, stacked), head_vjp, (rows, totals) = jax.vjp(head_of, leaves, has_aux=True)
    at, in_stack = found["at"], found["in_stack"]
    rest_leaves = [x for x, s in zip(leaves, in_stack) if not s]
    n_rows = jax.tree.leaves(carry)[0].shape[0]
    if n_rows % m:
        raise MeshError(f"schedule='1f1b': microbatches={m} must divide each device's {n_rows} rows")
    # The micro-batches' inputs, read by the first stage, typed as varying over the stages.
    xs = jax.tree.map(lambda x: _vary(x, varying_axes(x) | {PIPELINE}), _cut_rows(carry, m))
    # The per-row inputs too: a stage reads another micro-batch's than its neighbours at a tick.
    row_mb = jax.tree.map(lambda x: _vary(x, varying_axes(x) | {PIPELINE}), _cut_rows(rows, m))
    batch_mb = _cut_rows(batch, m)
    per_stage = jax.tree.leaves(stacked)[0].shape[0]
    if virtual > 1 and (m % stages or per_stage % virtual or at.pick is None):
        raise MeshError(
            f"schedule='1f1b' with virtual_stages={virtual} (interleaved 1F1B) needs microbatches ({m}) a multiple of "
            f"the {stages} stages and virtual_stages to divide each stage's {per_stage} layers"
        )
    chunk = per_stage // virtual
    items = virtual * m  # (micro-batch, chunk) pairs a stage runs forward and backward
    fwd_mb, fwd_chunk, bwd_mb, bwd_chunk, bwd_item = (jnp.asarray(a, jnp.int32) for a in _orders(stages, m, virtual))
    # Per-layer outputs (router statistics): each stage's, for the layers it runs, wait from the
    # micro-batch's forward pass to its tail, where the stages' are put together; the gradient of
    # the floating ones waits from the tail to the stage's backward pass. Integers are counts.
    kinds = jax.tree.leaves(found["out_kinds"])
    out_def = jax.tree.structure(found["out_shapes"])

    def floating(leaf) -> bool:
        return jnp.issubdtype(leaf.dtype, jnp.inexact)

    def forward(block, h, r, stage, v):
        """This stage's chunk ``v`` of layers on one micro-batch, and their per-layer outputs
        ``[chunk, ...]`` as (floating, other) leaves; padding layers (past the real count)
        skipped, their outputs zero. Interleaved, each layer is picked out of the block inside its
        checkpoint (a chunk sliced out would be a residual: the chunk's weights in every slot)."""

        def one(c, layer_j):
            layer, j = layer_j
            if virtual == 1:
                new, out = at.layer_fn(c, layer, r)
            else:
                new, out = at.pick(c, (block, v * chunk + j), r)
            real = (v * stages + stage) * chunk + j < at.n_layers
            out = [jnp.where(real, o, jnp.zeros_like(o)) for o in jax.tree.leaves(out)]
            return jax.tree.map(lambda a, b: jnp.where(real, a, b), new, c), out

        y, outs = jax.lax.scan(one, h, (block if virtual == 1 else None, jnp.arange(chunk)))
        return (y, [o for o in outs if floating(o)]), [o for o in outs if not floating(o)]

    # The forward pass and the backward pass are each traced once (jitted: the residuals a trace
    # keeps depend on what it can see outside; here, on the arguments alone), so every tick keeps
    # the same residuals in the ring. ``layout``: how to rebuild the backward pass from them.
    layout: dict[str, Any] = {}

    @jax.jit
    def forward_vjp(block, h, r, stage, v):
        """The forward pass, its per-layer outputs and the residuals its backward pass needs,
        less the block and the rows (given to the backward pass again)."""
        (y, outs), back, counts = jax.vjp(lambda b, x: forward(b, x, r, stage, v), block, h, has_aux=True)
        res, res_def = jax.tree.flatten(back)
        given = {id(x): ("block", k) for k, x in enumerate(jax.tree.leaves(block))}
        given |= {id(x): ("rows", k) for k, x in enumerate(jax.tree.leaves(r))}
        where = tuple(given.get(id(x), ("kept", 0)) for x in res)
        kept = [x for x, w in zip(res, where) if w[0] == "kept"]
        if layout.setdefault("back", (res_def, where)) != (res_def, where):
            raise MeshError("schedule='1f1b': the stage's forward pass kept other residuals at another trace")
        layout["spaces"] = [getattr(jax.typeof(k), "memory_space", None) for k in kept]
        return y, outs, counts, kept

    @jax.jit
    def backward(kept, block, r, stage, v, g):
        res_def, where = layout["back"]
        kept, given = iter(kept), {"block": jax.tree.leaves(block), "rows": jax.tree.leaves(r)}
        res = [next(kept) if w[0] == "kept" else given[w[0]][w[1]] for w in where]
        return jax.tree.unflatten(res_def, res)(g)

    def per_layer(outs, counts):
        """The whole stack's per-layer outputs ``[n_layers, ...]`` from every stage's chunks'
        (``[V, chunk, ...]`` each, on its own stage), combined as over one micro-batch of the
        ``M``: a mean's share is ``1/M`` of it. Chunk ``v`` of stage ``s`` is layers ``(v·P + s)·chunk``..."""
        outs, counts, leaves_ = iter(outs), iter(counts), []
        for kind, shape in zip(kinds, jax.tree.leaves(found["out_shapes"])):
            mine = next(outs) if jnp.issubdtype(shape.dtype, jnp.inexact) else next(counts)  # [V, chunk, ...]
            full = jnp.zeros((virtual, stages, *mine.shape[1:]), mine.dtype)
            full = jax.lax.dynamic_update_index_in_dim(_vary(full, varying_axes(mine)), mine, stage, 1)
            full = jax.lax.psum(full, PIPELINE).reshape(virtual * stages * chunk, *mine.shape[2:])[: at.n_layers]
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
        with split_at_stack(StackCut(record=False, output=output, totals=totals)) as cut:
            out = loss_of(jax.tree.unflatten(treedef, flat), _at(batch_mb, i))
        if cut.used != len(totals):
            raise MeshError(
                f"schedule='1f1b': the loss took {cut.used} batch totals on a micro-batch and {len(totals)} on the batch"
            )
        return out

    # The rings' shapes, from the forward pass's trace (shapes and types only).
    zero = _vary(jnp.zeros((), jnp.int32), frozenset({PIPELINE}))  # a chunk index, as a tick computes it
    y_shape, out_shapes, count_shapes, kept_shapes = jax.eval_shape(forward_vjp, stacked, _at(xs, 0), _at(row_mb, 0),
                                                                    stage, zero)  # fmt: skip
    slots = ring_slots(stages, m, virtual)
    waits = min(m, 2 * stages)  # micro-batches whose per-layer outputs' gradients a stage holds

    def like(s, lead: tuple[int, ...] = ()) -> Array:
        return _zeros_of(s, lead, {PIPELINE})

    # A slot more than the ring's: a stage with no forward pass at a tick writes there. (Written
    # unconditionally, an offloaded tensor's slot stays in host memory: no select between the
    # host and the device.)
    ring = [like(s, (slots + 1,)) for s in kept_shapes]
    ring = [jax.device_put(r, space) if space == jax.memory.Space.Host else r for r, space in zip(ring, layout["spaces"])]
    # Interleaved, the last stage hands a micro-batch's chunk on to the first (and its gradient back).
    up = [(i, (i + 1) % stages) for i in range(stages if virtual > 1 else last)]
    down = [((i + 1) % stages, i) for i in range(stages if virtual > 1 else last)]

    def all_chunks(s) -> Array:  # a per-layer output's placeholder for every chunk of the stage
        return like(s, (virtual,))

    _, aux_shape = jax.eval_shape(lambda: tail(rest_leaves, jax.tree.map(like, y_shape), [all_chunks(s) for s in out_shapes],
                                               [all_chunks(s) for s in count_shapes], 0))  # fmt: skip

    state = {
        "fwd": jax.tree.map(like, y_shape),  # what the previous stage handed over
        "bwd": jax.tree.map(like, y_shape),  # the cotangent the next stage handed back
        "ring": ring,
        "outs": [like(s, (slots + 1,)) for s in out_shapes],  # per-layer outputs awaiting the tail
        "counts": [like(s, (slots + 1,)) for s in count_shapes],
        "d_outs": [like(s, (waits, virtual)) for s in out_shapes],  # their gradients awaiting the backward pass
        "g_block": jax.tree.map(_zeros_like, stacked),
        "g_rest": [_zeros_like(x) for x in rest_leaves],
        "dx": jax.tree.map(lambda x: _zeros_like(x), xs),
        "loss": jnp.zeros((), jnp.float32),
        "aux": jax.tree.map(_zeros_of, aux_shape),
    }

    def put_all(buffers, values, at_):
        return [jax.lax.dynamic_update_index_in_dim(b, v, at_, 0) for b, v in zip(buffers, values)]

    def get_all(buffers, at_):
        return [jax.lax.dynamic_index_in_dim(b, at_, keepdims=False) for b in buffers]

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

    def tick(state, t, *, fwd: bool, bwd: bool):
        state = dict(state)
        dy = None
        if fwd:
            i = t - stage
            on = (i >= 0) & (i < items)
            i = jnp.clip(i, 0, items - 1)
            mb, v = fwd_mb[i], fwd_chunk[i]
            h = jax.tree.map(lambda a, b: jnp.where((stage == 0) & (v == 0), a, b), _at(xs, mb), state["fwd"])
            y, outs, counts, kept = forward_vjp(stacked, h, _at(row_mb, mb), stage, v)
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
                    dy, state = jax.lax.cond(done, lambda s: run_tail(s, y, t),
                                             lambda s: (jax.tree.map(_zeros_like, y), s), state)  # fmt: skip
        if bwd:
            k = t - (virtual * stages - 1) - (last - stage)
            on = (k >= 0) & (k < items)
            k = jnp.clip(k, 0, items - 1)
            mb, v, item = bwd_mb[k], bwd_chunk[k], bwd_item[k]
            from_tail = (stage == last) & (v == virtual - 1)
            g = state["bwd"] if dy is None else jax.tree.map(lambda a, b: jnp.where(from_tail, a, b), dy, state["bwd"])
            d_outs = [jax.lax.dynamic_index_in_dim(jax.lax.dynamic_index_in_dim(b, mb % waits, keepdims=False), v,
                                                   keepdims=False) for b in state["d_outs"]]  # fmt: skip
            g_block, dh = backward(get_all(state["ring"], item % slots), stacked, _at(row_mb, mb), stage, v, (g, d_outs))
            state["g_block"] = jax.tree.map(lambda a, b: a + jnp.where(on, b, jnp.zeros_like(b)), state["g_block"], g_block)
            state["dx"] = jax.tree.map(lambda a, b: _put(a, mb, b, on & (stage == 0) & (v == 0)), state["dx"], dh)
            state["bwd"] = jax.tree.map(lambda a: jax.lax.ppermute(a, PIPELINE, down), dh)
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

    # 3. The stack input's cotangent (the first stage's) back through what precedes the stack.
    dx = jax.tree.map(lambda d, c: sum_to_varying_of(d.reshape(c.shape), c), state["dx"], carry)
    (d_head,) = head_vjp((dx, state["g_block"]))
    g_rest = iter(state["g_rest"])
    grads = [d if s else d + next(g_rest) for d, s in zip(d_head, in_stack)]
    return (state["loss"], state["aux"]), jax.tree.unflatten(treedef, grads)
