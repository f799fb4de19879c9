"""Peak temporary memory of a traced program, from its jaxpr alone (nothing compiled or run).

A liveness walk over the program in trace order: every value the compiler would materialise
is a buffer from the equation that produces it to its last use. What is materialised follows
XLA's fusion in broad strokes: elementwise work (casts, broadcasts, slices, the inputs of a
reduction) fuses into its consumer and never exists on its own, unless several equations read
it, a non-fusible one does (a matmul, a collective, a loop) or it leaves its jaxpr (a loop
body's outputs). Reshapes and names are views. Calls (``jit``, ``remat``, ``shard_map``,
custom rules) are inlined; an equation that repeats an earlier one on the same operands is the
earlier one (XLA's common-subexpression elimination: a recomputed forward pass outside a loop
is its forward pass). A loop's body runs inside the loop's time span, its stacked outputs and
any state it starts from a broadcast exist from the start of its program (XLA's schedules put
the broadcast that initialises them first), and a scan's per-iteration slice is copied out
where a matmul reads it. A loop that runs once is inlined (XLA removes it). A ``while`` loop
holds its own copy of the loop-invariant operands it carries (XLA's loop state); its results
are written over their initial values, and a conditional's over operands of their type, where
nothing reads those buffers afterwards under any name, a body's inputs included (XLA's
in-place loop state and conditional buffers: gradient accumulators).

Two figures come out: the **live peak**, the most bytes live at once, and the **heap**, those
buffers packed into one arena by size, best fit first, as XLA's buffer assignment packs its
temporaries (the heap is larger where buffers of different sizes and lifetimes interleave:
measured on XLA:CPU, 0-27% above the live peak, MoE layers the most).

This is a model of the compiler, not the compiler: ``zoo.plan.measure`` compiles the same
program and reads XLA's own figures, and ``tests/test_plan.py`` holds the two together.

Here the program is built from the jaxpr (what is materialised, who reads it);
``zoo.plan._buffers`` lays its buffers on a timeline and finds the two figures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax._src import core
from jax._src.interpreters import partial_eval as pe

from zoo.plan._buffers import Buffer, Op, Peak, Program, intervals, live_peak, peak
from zoo.plan.jaxprs import CALLS, ClosedJaxpr, call_jaxpr, jaxpr_of, nbytes, scan_operands

# Work XLA fuses into its consumer: elementwise arithmetic and logic, casts, broadcasts, slices.
FUSIBLE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "concatenate", "conj", "convert_element_type", "cos", "cosh", "div", "dynamic_slice", "eq", "erf",
    "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pad", "pow", "real",
    "reduce_and", "reduce_max", "reduce_min", "reduce_or", "reduce_prod", "reduce_sum", "reduce_xor", "rem", "rev",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh",
    "slice", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "transpose", "xor", "iota", "broadcast_in_dim",
    "squeeze", "expand_dims", "split",
})  # fmt: skip
# Recomputed inside each consumer rather than stored (cheap to duplicate).
DUPLICATED = frozenset({"iota", "broadcast_in_dim"})
# Views of their first operand: no new buffer. (``stop_gradient`` lowers to nothing: a frozen
# LoRA base's weights pass through it to the matmuls that read them.)
VIEWS = frozenset({"reshape", "squeeze", "expand_dims", "name", "reduce_precision", "copy", "copy_p", "pvary",
                   "stop_gradient"})
# A reduction's output is a fusion root: materialised.
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                        "reduce_xor", "argmax", "argmin"})  # fmt: skip
LOOPS = frozenset({"scan", "while", "cond"})


def on_host(aval: Any) -> bool:
    """Whether a value lives in pinned host memory (``f32<host>[...]``)."""
    space = getattr(aval, "memory_space", None)
    return space is not None and "host" in str(space).lower()


# -- flattening: calls inlined, values crossing call boundaries ----------------------------------


class _Value:
    """One value of the flattened program; ``div``: the devices one global value outside
    ``shard_map`` is split over (its per-device bytes are ``nbytes / div``)."""

    __slots__ = ("aval", "div")

    def __init__(self, aval: Any, div: int = 1) -> None:
        self.aval, self.div = aval, div


@dataclass
class _Context:
    """What the walk needs beyond the jaxpr: ``unified`` memory (XLA:CPU: host and device are
    one RAM, so transfers are no-ops and nothing is on host); per-device divisors by global
    shape, for values outside ``shard_map`` that GSPMD splits like the parameters."""

    unified: bool = False
    shape_div: dict[tuple[int, ...], int] = field(default_factory=dict)
    cse: bool = True  # merge repeated equations (XLA's common-subexpression elimination)
    texts: dict[Any, Any] = field(default_factory=dict)  # jaxprs printed, by id (:func:`_full`)


@dataclass(eq=False)
class _Eqn:
    name: str
    eqn: Any  # the jaxpr equation (None for a synthetic slice)
    ins: list[Any]  # values read (None for literals)
    outs: list[Any]
    ids: list[Any] = field(default_factory=list)  # what each operand is (:func:`_identity`)


def _flatten(
    jaxpr: core.Jaxpr,
    env: dict[Any, Any],
    out: list[_Eqn],
    ctx: _Context,
    local: bool,
    same: dict[Any, Any] | None = None,
    seen: dict[Any, list[tuple[Any, Any]]] | None = None,
) -> None:
    """Append ``jaxpr``'s primitives to ``out``, calls (and loops that run once) inlined;
    ``local``: inside ``shard_map``, where shapes are already per device.

    An equation that repeats an earlier one (the same primitive and parameters on the same
    operands) is not appended: its outputs are the earlier one's, as XLA's common-subexpression
    elimination makes them. (Under ``jax.checkpoint(prevent_cse=False)`` a layer's recomputed
    forward pass is its forward pass, where no loop separates them: a layer of its own, whose
    one-trip scan XLA removes, keeps what its backward pass reads from its forward pass on; a
    custom rule's backward pass reads the forward pass's gathers, not copies of its own.)
    ``same``: each variable's identity for that comparison (the variable its value was first
    computed as); ``seen``: the equations so far, by what they compute."""
    same = {} if same is None else same
    seen = {} if seen is None else seen
    for eqn in jaxpr.eqns:
        ins = [env.get(v) if isinstance(v, core.Var) else None for v in eqn.invars]
        name = eqn.primitive.name
        if ctx.unified and name == "device_put":
            for ov, v, iv in zip(eqn.outvars, ins, eqn.invars):
                env[ov] = v  # one memory: a transfer is a no-op
                same[ov] = _identity(iv, same)
            continue
        sub = None
        if name in CALLS and call_jaxpr(eqn) is not None:
            sub = jaxpr_of(call_jaxpr(eqn))
        elif name == "scan" and eqn.params["length"] == 1:
            sub = jaxpr_of(eqn.params["jaxpr"])  # its xs[0] is a view of xs
        if sub is not None:
            sub_env: dict[Any, Any] = {v: None for v in sub.constvars}
            sub_env.update(zip(sub.invars, ins))
            same.update((sv, _identity(iv, same)) for sv, iv in zip(sub.invars, eqn.invars))
            _flatten(sub, sub_env, out, ctx, local or name == "shard_map", same, seen)
            for ov, sv in zip(eqn.outvars, sub.outvars):
                env[ov] = sub_env.get(sv) if isinstance(sv, core.Var) else None
                same[ov] = _identity(sv, same)
            continue
        # Compared first without the jaxprs' texts (printing a layer's body is most of a walk's
        # time), then, where that matches an earlier equation, with them.
        key = _computes(eqn, same, None) if ctx.cse else None
        earlier = next((pairs for prev, pairs in seen.get(key, ()) if _full(prev, ctx.texts) == _full(eqn, ctx.texts)),
                       None) if key is not None else None  # fmt: skip
        if earlier is not None:
            for ov, (prev, value) in zip(eqn.outvars, earlier):
                env[ov], same[ov] = value, same.get(prev, prev)
            continue
        outs = []
        for ov in eqn.outvars:
            env[ov] = value = _Value(ov.aval, 1 if local else _divisor(ov.aval, ins, ctx))
            outs.append(value)
        if key is not None:
            seen.setdefault(key, []).append((eqn, list(zip(eqn.outvars, outs))))
        out.append(_Eqn(name, eqn, ins, outs, [_identity(v, same) for v in eqn.invars]))


def _identity(v: Any, same: dict[Any, Any]) -> Any:
    """What a jaxpr operand is, for :func:`_computes`: a literal its value, a variable the one
    its value was first computed as."""
    if isinstance(v, core.Literal):
        return ("literal", str(v.aval), repr(v.val))
    return same.get(v, v)


def _full(eqn: Any, texts: dict[Any, Any]) -> Any:
    """An equation's parameters with its jaxprs by their texts (once per equation and walk)."""
    if ("eqn", id(eqn)) not in texts:
        texts[("eqn", id(eqn))] = tuple(sorted((k, _frozen(v, texts)) for k, v in eqn.params.items()))
    return texts[("eqn", id(eqn))]


def _computes(eqn: Any, same: dict[Any, Any], texts: dict[Any, Any] | None) -> Any:
    """What an equation computes, hashable (equal for two that XLA's CSE would merge); None
    for one it would not: with effects, or parameters not comparable. (Collectives are merged
    too: ``shard_map`` lowers each with the same channel, and XLA:CPU keeps one all-gather of a
    layer's weights for its forward pass and its recomputation.) ``texts`` None: jaxprs by their
    signature only (see :func:`_frozen`)."""
    if any(not isinstance(e, core.NamedAxisEffect) for e in eqn.effects):  # a collective's axis is no effect
        return None
    try:
        params = tuple(sorted((k, _frozen(v, texts)) for k, v in eqn.params.items()))
        key = (eqn.primitive.name, params, tuple(_identity(v, same) for v in eqn.invars))
        hash(key)
    except TypeError:
        return None
    return key


def _text(jaxpr: core.Jaxpr, texts: dict[Any, Any]) -> str:
    """``jaxpr`` printed, once per walk (a layer's body is long; the walk holds the jaxpr)."""
    if id(jaxpr) not in texts:
        texts[id(jaxpr)] = str(jaxpr)
    return texts[id(jaxpr)]


def _frozen(x: Any, texts: dict[Any, Any] | None) -> Any:
    """A parameter as a hashable value: a jaxpr by its text (XLA compares a loop's or a call's
    computations by what they compute: a recomputed forward pass's loops are jaxprs of their
    own, the same text), or with ``texts`` None by its signature (its equations' count and its
    inputs' and outputs' types); another object by identity."""
    if isinstance(x, (ClosedJaxpr, core.Jaxpr)):
        # (From jax 0.12.1 a jaxpr carries its constants: ``ClosedJaxpr`` is ``Jaxpr``.)
        inner, consts = jaxpr_of(x), tuple(id(c) for c in getattr(x, "consts", ()))
        if texts is None:
            return ("jaxpr", len(inner.eqns), tuple(str(v.aval) for v in (*inner.invars, *inner.outvars)), consts)
        return ("jaxpr", _text(inner, texts), consts)
    if isinstance(x, (tuple, list)):
        return tuple(_frozen(y, texts) for y in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v, texts)) for k, v in x.items()))
    if isinstance(x, np.ndarray):
        return (x.dtype.str, x.shape, x.tobytes())
    try:
        hash(x)
    except TypeError:
        return ("object", id(x))
    return x


def _divisor(aval: Any, ins: list[Any], ctx: _Context) -> int:
    """Per-device split of a global value outside ``shard_map``: that of an operand of its
    shape (elementwise work keeps the layout), else that of a parameter of its shape."""
    shape = tuple(getattr(aval, "shape", ()))
    for v in ins:
        if v is not None and tuple(getattr(v.aval, "shape", ())) == shape and v.div > 1:
            return v.div
    return ctx.shape_div.get(shape, 1)


def _live_eqns(flat: list[_Eqn], leaving: list[Any]) -> list[_Eqn]:
    """``flat`` less the equations nothing reads (those with effects kept, a collective's axis
    names not counting). The top level's dead code is gone already (``pe.dce_jaxpr``); this is
    a ``while`` body's or a branch's, which JAX lowers but XLA removes, collectives included
    (XLA:CPU and XLA:TPU checked): e.g. the output a MoE dispatch's later rounds compute in
    their backward loop (``jax.vjp`` of a round) and send back, unread."""
    used = {id(v) for v in leaving if v is not None}
    keep = []
    for e in reversed(flat):
        if any(id(v) in used for v in e.outs) or (e.eqn is not None and pe.has_effects(e.eqn)):
            keep.append(e)
            used.update(id(v) for v in e.ins if v is not None)
    return keep[::-1]


def _program(
    jaxpr: core.Jaxpr,
    env: dict[Any, Any],
    pinned: dict[int, Buffer],
    ctx: _Context,
    sliced: int = 0,
    local: bool = True,
) -> Program:
    """The buffers and ops of ``jaxpr``: which values are materialised, who reads them."""
    flat: list[_Eqn] = []
    if sliced:  # a scan body's per-iteration slices of its stacked inputs
        for v in jaxpr.invars[len(jaxpr.invars) - sliced :]:
            env[v] = value = _Value(v.aval)
            flat.append(_Eqn("dynamic_slice", None, [None], [value]))
    same: dict[Any, Any] = {}
    _flatten(jaxpr, env, flat, ctx, local, same)
    leaving_vals = [env.get(v) if isinstance(v, core.Var) else None for v in jaxpr.outvars]
    flat = _live_eqns(flat, leaving_vals)
    # A body's inputs (no buffer of its own: the loop's state, a conditional's operands) by
    # identity: the last equation reading each, and those it returns.
    input_read: dict[Any, int] = {}
    for i, e in enumerate(flat):
        for x, k in zip(e.ins, e.ids):
            if x is None and not isinstance(k, tuple):
                input_read[k] = i
    input_leaving = {same.get(v, v) for v in jaxpr.outvars if isinstance(v, core.Var)}

    uses: dict[int, int] = {}
    strong: set[int] = set()  # read by a non-fusible primitive
    readers: dict[int, set[str]] = {}
    for e in flat:
        for v in e.ins:
            if v is not None:
                uses[id(v)] = uses.get(id(v), 0) + 1
                readers.setdefault(id(v), set()).add(e.name)
                if e.name not in FUSIBLE and e.name not in VIEWS:
                    strong.add(id(v))
    leaving = {id(v) for v in leaving_vals if v is not None}
    # A loop or a conditional reads a fused value through a view (a reshape) as it reads it
    # directly: materialised, where its producer's operands may die (an expert layer's float32
    # product cast to bfloat16 and reshaped for the overflow's conditional is its bfloat16 rows
    # there, not the float32 ones).
    bound = {id(v) for e in flat if e.name in LOOPS for v in e.ins if v is not None}
    for e in reversed(flat):
        if e.name in VIEWS and any(id(v) in bound for v in e.outs):
            bound.update(id(v) for v in e.ins if v is not None)
            strong.update(id(v) for v in e.ins if v is not None)

    def folded(e: _Eqn) -> bool:  # a transpose only matmuls read folds into them
        return e.name == "transpose" and readers.get(id(e.outs[0]), set()) == {"dot_general"}

    def kept(e: _Eqn, k: int) -> bool:  # whether value ``k`` of ``e`` is materialised
        return (
            e.name not in FUSIBLE
            or e.name in REDUCTIONS
            or (e.name not in DUPLICATED and (uses.get(k, 0) > 1 or k in strong or k in leaving))
        )

    # Which materialised values (or arguments) each value reads through views and fusions, and
    # the last equation reading each of those: an operand's buffer is dead after an op only if
    # no later equation reads it under any name.
    roots: dict[int, tuple[int, ...]] = {k: (k,) for k in pinned}
    last_read: dict[int, int] = {}
    for i, e in enumerate(flat):
        rs = tuple(r for v in e.ins if v is not None for r in roots.get(id(v), ()))
        for r in rs:
            last_read[r] = i
        for v in e.outs:
            alias = e.name in VIEWS or folded(e) or not kept(e, id(v))
            roots[id(v)] = rs if alias else (id(v),)
    leaving_roots = {r for v in leaving_vals if v is not None for r in roots.get(id(v), ())}

    def dead_after(v: Any, i: int) -> bool:
        rs = roots.get(id(v), ())
        return len(rs) == 1 and last_read.get(rs[0]) == i and rs[0] not in leaving_roots

    backing: dict[int, list[Buffer]] = {k: [b] for k, b in pinned.items()}
    made_by: dict[int, str] = {}  # each value's producing primitive
    ops: list[Op] = []
    for index, e in enumerate(flat):
        reads = [b for v in e.ins if v is not None for b in backing.get(id(v), [])]
        if e.name in VIEWS or folded(e):
            for v in e.outs:
                backing[id(v)] = list(reads)
                if e.name == "name":
                    for b in reads:
                        b.what = e.eqn.params["name"]
            continue
        writes: list[Buffer] = []
        if e.name == "dynamic_update_slice" and e.ins[0] is None and local:
            # An update of a loop body's input (the loop's state, counted by the loop): in place.
            backing[id(e.outs[0])] = []
            ops.append(Op(reads, []))
            continue
        reuse = _in_place(e, lambda v, index=index: dead_after(v, index), backing)
        if local:
            for i in _over_inputs(e, lambda k, index=index: input_read.get(k) == index and k not in input_leaving):
                # Written over a body input nothing reads afterwards (the gradient accumulators a
                # conditional's branch passes to its loop): in place, in the enclosing state.
                backing[id(e.outs[i])] = []
        for i, v in enumerate(e.outs):
            k = id(v)
            if k in backing and not backing[k]:
                continue
            if i in reuse:  # written over an operand nothing reads afterwards
                backing[k] = [reuse[i]]
                continue
            if kept(e, k):
                b = Buffer(nbytes(v.aval) // v.div, on_host(v.aval) and not ctx.unified, e.name)
                writes.append(b)
                backing[k] = [b]
                if e.name == "all_gather" and e.eqn.params.get("all_gather_dimension", 0) > 0:
                    # Gathered along an inner dimension: XLA gathers along the outer one and
                    # copies into the layout its readers need; both are live.
                    copy = Buffer(b.size, b.host, "all_gather relayout")
                    writes.append(copy)
                    backing[k].append(copy)
            else:
                backing[k] = list(reads)  # fused: its readers read what it reads
        op = Op(reads, writes)
        if e.name in LOOPS:
            _loop(e, op, backing, ctx)
            for i in _zeroed(e, made_by):
                for b in backing[id(e.outs[i])]:
                    if b in writes:
                        b.early = True
        for v in e.outs:
            made_by[id(v)] = e.name
        ops.append(op)
    outs = [b for v in leaving_vals if v is not None for b in backing.get(id(v), [])]
    return Program(ops, outs)


def _in_place(e: _Eqn, dead: Callable[[Any], bool], backing: dict[int, list[Buffer]]) -> dict[int, Buffer]:
    """Outputs of a loop, ``cond`` or ``dynamic_update_slice`` that XLA writes over an operand's
    buffer: a loop's carry over its initial value, a conditional's output over an operand of its
    type, an updated slice into the array it updates,
    where this op is the last reader of that operand's buffer under any name (``dead``; the
    gradient accumulators a loop adds into)."""
    if e.name not in ("while", "scan", "cond", "dynamic_update_slice"):
        return {}

    def reusable(v) -> Buffer | None:  # v's own buffer, if this op is its last reader
        if v is None or not dead(v):
            return None
        bufs = backing.get(id(v), [])
        return bufs[0] if len(bufs) == 1 and not bufs[0].pinned else None

    reuse: dict[int, Buffer] = {}
    if e.name == "dynamic_update_slice":  # XLA updates the operand's buffer in place
        b = reusable(e.ins[0])
        if b is not None and b.size == nbytes(e.outs[0].aval) // e.outs[0].div:
            reuse[0] = b
        return reuse
    if e.name in ("while", "scan"):
        p = e.eqn.params
        n, carries = scan_operands(p) if e.name == "scan" else (p["cond_nconsts"] + p["body_nconsts"], len(e.outs))
        for i, out in enumerate(e.outs[:carries]):
            b = reusable(e.ins[n + i])
            if b is not None and b.size == nbytes(out.aval) // out.div:
                reuse[i] = b
        return reuse
    free = [(v, b) for v in e.ins[1:] if (b := reusable(v)) is not None]
    for i, out in enumerate(e.outs):
        for j, (v, b) in enumerate(free):
            if (
                v.aval.shape == out.aval.shape
                and v.aval.dtype == out.aval.dtype
                and b.size == nbytes(out.aval) // out.div
            ):
                reuse[i] = b
                del free[j]
                break
    return reuse


def _over_inputs(e: _Eqn, dead: Callable[[Any], bool]) -> list[int]:
    """Outputs of a loop or ``cond`` in a body that XLA writes over a body input (an operand with
    no buffer in this body, ``None``) that is ``dead`` after it: a loop's carry over its initial
    value, a conditional's output over an operand of its type."""
    if e.name not in ("while", "scan", "cond"):
        return []

    def free(j: int) -> bool:
        return e.ins[j] is None and isinstance(e.eqn.invars[j], core.Var) and dead(e.ids[j])

    if e.name in ("while", "scan"):
        p = e.eqn.params
        n, carries = scan_operands(p) if e.name == "scan" else (p["cond_nconsts"] + p["body_nconsts"], len(e.outs))
        return [i for i in range(carries) if free(n + i) and e.eqn.invars[n + i].aval == e.eqn.outvars[i].aval]
    got, taken = [], set()
    for i, ov in enumerate(e.eqn.outvars):
        for j in range(1, len(e.ins)):
            if j not in taken and free(j) and e.eqn.invars[j].aval == ov.aval:
                got.append(i)
                taken.add(j)
                break
    return got


def _zeroed(e: _Eqn, made_by: dict[int, str]) -> list[int]:
    """Outputs of a loop whose state XLA initialises from a broadcast (a scan's stacked outputs,
    zeros; a carry started from a broadcast). XLA:CPU's schedules place such a broadcast, which
    reads nothing, where their depth-first walk from the program's results first reaches the
    loop: before the loop's other operands are computed, at the start of the program in the
    buffer assignments read (the capacity kernel's gradient loop: its [E, C, D] output's zeros
    first in the step, live through the whole backward pass)."""
    p = e.eqn.params
    if e.name == "scan":
        n, carries = scan_operands(p)
    elif e.name == "while":
        n, carries = p["cond_nconsts"] + p["body_nconsts"], len(e.outs)
    else:
        return []
    got = list(range(carries, len(e.outs)))
    for i in range(carries):
        v = e.ins[n + i]
        if v is not None and made_by.get(id(v)) == "broadcast_in_dim":
            got.append(i)
    return got


def _loop(e: _Eqn, op: Op, backing: dict[int, list[Buffer]], ctx: _Context) -> None:
    p = e.eqn.params
    if e.name == "scan":
        body = jaxpr_of(p["jaxpr"])
        n_xs = len(body.invars) - sum(scan_operands(p))
        op.body = _body(body, n_xs, ctx)
        op.body.length = p["length"]
    elif e.name == "while":
        op.body = _body(jaxpr_of(p["body_jaxpr"]), 0, ctx)
        n_consts = p["cond_nconsts"] + p["body_nconsts"]
        # One copy of each value (an all-gather's relayout copy is a second buffer of the same
        # value: XLA's loop state holds one, in the layout the body reads).
        carried = {id(bs[0]): bs[0] for v in e.ins[:n_consts] if v is not None and (bs := backing.get(id(v)))}
        op.state = [Buffer(b.size, b.host, "while state") for b in carried.values()]
    else:
        branches = [_body(jaxpr_of(b), 0, ctx) for b in p["branches"]]
        op.body = max(branches, key=lambda prog: live_peak(intervals(prog))[0])


def _body(jaxpr: core.Jaxpr, sliced: int, ctx: _Context) -> Program:
    env: dict[Any, Any] = {v: None for v in (*jaxpr.constvars, *jaxpr.invars)}
    return _program(jaxpr, env, {}, ctx, sliced)


def program_peak(
    closed: Any,
    *,
    arg_divisors: list[int] | None = None,
    unified: bool = False,
    shape_div: dict[tuple[int, ...], int] | None = None,
) -> tuple[Peak, list[Peak]]:
    """Temporaries of a whole program (its arguments and outputs are not temporaries), and
    those of each scan body run more than once (a layer's), largest first.

    ``arg_divisors``: per flat argument, the devices it is split over (per-device bytes are its
    global bytes over that); ``shape_div``: the same by global shape, for values the program
    derives from them outside ``shard_map``. ``unified``: one memory for host and device."""
    # Dead code first removed, as XLA removes it (the 1F1B step traces its loss once on the whole
    # batch for the stack's block and the batch's counts, most of it unused).
    jaxpr = jaxpr_of(closed)
    jaxpr, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    ctx = _Context(unified, dict(shape_div or {}))
    env: dict[Any, Any] = {}
    pinned: dict[int, Buffer] = {}
    given = list(arg_divisors or [])
    divs = [given[k] if k < len(given) else 1 for k, u in enumerate(used) if u]  # of the arguments still read
    for i, v in enumerate((*jaxpr.constvars, *jaxpr.invars)):
        k = i - len(jaxpr.constvars)
        d = divs[k] if 0 <= k < len(divs) else 1
        env[v] = value = _Value(v.aval, d)
        pinned[id(value)] = Buffer(nbytes(v.aval) // d, on_host(v.aval) and not unified, "argument", pinned=True)
    prog = _program(jaxpr, env, pinned, ctx, local=False)
    for b in prog.outputs:
        b.pinned = True
    bodies = [peak(op.body) for op in _loops(prog) if op.body.length > 1]
    return peak(prog), sorted(bodies, key=lambda p: -p.device)


def _loops(prog: Program) -> list[Op]:
    out = []
    for op in prog.ops:
        if op.body is not None:
            out.append(op)
            out.extend(_loops(op.body))
    return out
