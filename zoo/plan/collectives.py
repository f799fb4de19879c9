"""The collectives of a training step: counted on the traced program, priced on the links they cross.

:func:`traced` reads every collective of a traced step (``shard_map``'s explicit ones: FSDP's
all-gathers and the reduce-scatters autodiff makes of them, tensor all-reduces, expert
all-to-alls, context gathers, the batch axes' gradient all-reduce) with the per-device bytes
of its buffer and how often it runs (the product of the scans around it). :func:`hlo_traffic`
reads the same from a compiled program's HLO text, for the tests to hold the two together.

:func:`link` says which link a collective over some mesh axes crosses: devices are numbered in
the mesh's axis order (``zoo.parallel.AXES``: data, fsdp, context, tensor, expert; the last
varies fastest), and a group of devices inside one fast domain (``Hardware.domain``) uses
``domain_link``; :func:`collective_seconds` prices a group spanning domains (its devices in each
domain share the crossing). :func:`seconds` prices one ring: an all-gather, reduce-scatter or
all-to-all moves ``(n-1)/n`` of its buffer through each device, an all-reduce twice that.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax._src import core

from zoo.errors import ConfigError
from zoo.layers.moe_dispatch import LATER_ROUNDS
from zoo.parallel import AXES, WEIGHT_SHARDS
from zoo.placement import subjaxprs
from zoo.plan._step import tick_ring
from zoo.plan.jaxprs import CALLS, call_jaxpr, jaxpr_of, later_rounds, nbytes

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "permute")
_PRIMITIVES = {
    "all_gather": "all_gather", "all_gather_invariant": "all_gather", "reduce_scatter": "reduce_scatter",
    "psum_invariant": "all_reduce",
    "psum": "all_reduce", "all_to_all": "all_to_all", "ppermute": "permute", "ragged_all_to_all": "all_to_all",
}  # fmt: skip


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind over ``axes``: per-device ``nbytes`` of each buffer (the gathered
    or unscattered side), run ``count`` times a step; ``layer``: inside a scanned layer stack;
    ``backward``: in a scan that also reduce-scatters (FSDP's backward pass); ``overlap``: the
    loop around it also computes (a loop of gathers alone has nothing to hide them behind).
    ``tick``: where it runs in a pipelined step, which says how it grows with the interleaved
    schedule's virtual stages (:meth:`Traffic.seconds`): ``"tick"`` once per tick of the
    pipeline's tick loop (the hand-overs), ``"stage"`` per tick and per layer of the stage (in
    the layer scan inside the tick loop), ``"hoisted"`` once per layer of the stage in a loop of
    gathers alone (FSDP's forward gathers, which JAX hoists out of a GPipe tick loop), ``""``
    elsewhere."""

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    count: int
    layer: bool
    backward: bool = False
    overlap: bool = True
    tick: str = ""

    @property
    def total(self) -> int:
        return self.nbytes * self.count


def _axes(eqn: core.JaxprEqn) -> tuple[str, ...]:
    names = eqn.params.get("axis_name", eqn.params.get("axes", ()))
    names = names if isinstance(names, tuple) else (names,)
    return tuple(a for a in AXES if a in names)


def _buffer(kind: str, eqn: core.JaxprEqn) -> int:
    if kind == "all_gather":
        return sum(nbytes(v.aval) for v in eqn.outvars)
    if eqn.primitive.name == "ragged_all_to_all":
        # Only the slices sent move: at most the smaller of what is sent from and written into
        # (the MoE dispatch's sorted pairs, then on the way back the pairs they return to).
        return min(nbytes(eqn.invars[0].aval), nbytes(eqn.invars[1].aval))
    return sum(nbytes(v.aval) for v in eqn.invars if isinstance(v, core.Var))


def traced(jaxpr: Any, sizes: Mapping[str, int]) -> list[Collective]:
    """Every collective of a traced step over axes of size > 1, merged by (kind, axes, bytes,
    scope). Scans multiply what they hold by their length; the outermost is the step's loop over
    micro-batches, a layer scan one of length > 1 inside it, or the pipeline's tick loop
    (:func:`zoo.plan._step.is_tick_scan`) and the stage's layer scan inside that."""
    stages = sizes.get("pipeline", 1)

    found: dict[tuple, int] = {}

    def has_scatter(j: core.Jaxpr) -> bool:
        for e in j.eqns:
            if e.primitive.name == "reduce_scatter" and _weight_axes(_axes(e)):
                return True
            if any(has_scatter(jaxpr_of(s)) for s in _subs(e)):
                return True
        return False

    def has_dot(j: core.Jaxpr) -> bool:
        todo = [j]
        while todo:
            for e in todo.pop().eqns:
                if e.primitive.name in ("dot_general", "ragged_dot", "ragged_dot_general"):
                    return True
                todo.extend(jaxpr_of(s) for s in _subs(e))
        return False

    def walk(j: core.Jaxpr, times: int, depth: int, layer: bool, backward: bool, inlined: bool, tick: bool,
             dots: bool, where: str = "", ring: bool = False) -> None:  # fmt: skip
        # where: "tick" in a tick loop's body, "stage" in a scan inside it; ring: the tick loop
        # is the interleaved schedule's (its hand-overs close the ring of stages).
        for e in j.eqns:
            name = e.primitive.name
            kind = _PRIMITIVES.get(name)
            if kind is not None:
                axes = tuple(a for a in _axes(e) if sizes.get(a, 1) > 1)
                size = _buffer(kind, e)
                if inlined and kind == "all_gather" and _weight_axes(axes):
                    continue  # the re-gather of a stack XLA inlines is the forward gather, CSE'd
                if axes and size:
                    hoisted = stages > 1 and not where and layer and not dots
                    key = (kind, axes, size, layer, backward, dots, "hoisted" if hoisted else where)
                    found[key] = found.get(key, 0) + times
                continue
            if name == "scan":
                body = jaxpr_of(e.params["jaxpr"])
                n = e.params["length"]
                if depth == 0:  # make_train_step's loop over micro-batches
                    walk(body, times * n, 1, layer, backward, inlined, False, dots)
                    continue
                inner = layer or n > 1
                back = has_scatter(body)
                # A stack of one layer is inlined by XLA: its backward pass's FSDP re-gathers
                # repeat the forward pass's gathers of the same weights, and XLA keeps one. A
                # stage of one layer inside the pipeline's tick loop likewise: its weights are
                # the same at every tick, and XLA hoists the re-gather out of the loop. Not in
                # the interleaved schedule's: each tick slices another chunk of the stage.
                one = n == 1 and back and (not inner or (tick and not ring))
                pairs = tick_ring(body)
                inside = "tick" if pairs else ("stage" if where else "")
                walk(body, times * n, depth + 1, inner, backward or (inner and not layer and back),
                     inlined or one, pairs > 0, has_dot(body), inside, pairs == stages if pairs else ring)  # fmt: skip
                continue
            if later_rounds(e):
                continue  # priced as not run (zoo.plan.jaxprs.later_rounds)
            for sub in _subs(e):
                walk(jaxpr_of(sub), times, depth, layer, backward, inlined, tick, dots, where, ring)

    walk(jaxpr_of(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr), 1, 0, False, False, False, False, True)
    return [Collective(k, a, s, c, lay, bw, ov, tk) for (k, a, s, lay, bw, ov, tk), c in found.items()]


def _subs(eqn: core.JaxprEqn) -> list[Any]:
    if eqn.primitive.name in CALLS and call_jaxpr(eqn) is not None:
        return [call_jaxpr(eqn)]
    return list(subjaxprs(eqn))


def totals(collectives: list[Collective], floor: int = 0) -> dict[tuple[str, tuple[str, ...]], int]:
    """Bytes per step by (kind, axes), buffers under ``floor`` bytes left out."""
    out: dict[tuple[str, tuple[str, ...]], int] = {}
    for c in collectives:
        if c.nbytes >= floor:
            out[(c.kind, c.axes)] = out.get((c.kind, c.axes), 0) + c.total
    return out


# -- the compiled program -----------------------------------------------------------------------

_HLO_KIND = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter", "all-reduce": "all_reduce",
             "all-to-all": "all_to_all", "collective-permute": "permute", "ragged-all-to-all": "all_to_all"}  # fmt: skip
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%[\w.-]+ = (.+?) ([a-z][\w-]*)\((.*)$")
_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|pred|s8|u8|f64|s64)\[([\d,]*)\]")


def shape_bytes(text: str) -> int:
    """Bytes of every HLO shape written in ``text`` (``f32[4,8]``, ``bf16[2]``...), added up."""
    return sum(_DTYPE_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _SHAPE.findall(text))


def _groups(line: str, n_devices: int) -> list[list[int]]:
    """A collective's device groups, from any of XLA's spellings: listed (``{{0,1},{2,3}}``), an
    iota (``[2,2]<=[4]``), or from jax 0.12.1 the mesh and the axes it runs over
    (``mesh['fsdp'=2,'expert'=4] {'expert'}``: devices numbered row-major over the mesh)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        listed = re.findall(r"'([\w-]+)'=(\d+)", m.group(1))
        names, dims = [a for a, _ in listed], [int(s) for _, s in listed]
        over = [names.index(a) for a in re.findall(r"'([\w-]+)'", m.group(2))]
        rest = [i for i in range(len(names)) if i not in over]
        ids = np.arange(math.prod(dims)).reshape(dims).transpose(rest + over)
        return ids.reshape(-1, math.prod(dims[i] for i in over)).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    return [list(range(n_devices))]


def _pairs(line: str) -> list[list[int]]:
    """A collective-permute's (source, target) device pairs."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))] if m else [[0]]


def hlo_traffic(hlo: str, sizes: Mapping[str, int], floor: int = 0) -> dict[tuple[str, tuple[str, ...]], int]:
    """Per-device bytes per step by (kind, mesh axes) of a compiled SPMD program's collectives
    (``compiled.as_text()``), each buffer times the trip counts of the ``while`` loops around
    it; the axes of a group are read off its device ids (numbered in the mesh's axis order).
    Buffers under ``floor`` bytes are left out; an all-reduce of a tuple counts every element."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY\s+)?%([\w.-]+) .*\{\s*$", line)
        if m and not line.startswith(" "):
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is not None and line.strip() == "}":
            current = None
            continue
        if current is not None:
            comps[current].append(line)
    results = {}  # an instruction's result shape by its name (operands are printed by name alone on TPU)
    for lines in comps.values():
        for line in lines:
            if d := re.match(r"^\s*(?:ROOT\s+)?%([\w.-]+) = (\w+\[[\d,]*\])", line):
                results[d.group(1)] = d.group(2)
    shape = [sizes.get(a, 1) for a in AXES]
    n = math.prod(shape)
    out: dict[tuple[str, tuple[str, ...]], int] = {}

    def axes_of(group: list[int]) -> tuple[str, ...]:
        coords = np.array(np.unravel_index(np.asarray(group), shape))
        return tuple(a for a, row in zip(AXES, coords) if len(set(row.tolist())) > 1)

    def visit(name: str, times: int) -> None:
        for line in comps.get(name, []):
            m = _INSTR.match(line)
            if not m:
                continue
            result, op = m.group(1), m.group(2)
            base = op.removesuffix("-start")
            if base in _HLO_KIND:
                kind = _HLO_KIND[base]
                groups = _pairs(line) if kind == "permute" else _groups(line, n)
                # Sizes from the result: an all-reduce or all-to-all keeps its operand's shape
                # (a tuple: one buffer per element), a reduce-scatter's operand is its result
                # times the group.
                scale = len(groups[0]) if kind == "reduce_scatter" else 1
                parts = [b * scale for b in map(shape_bytes, re.findall(r"\w+\[[\d,]*\]", result))]
                # A combined all-reduce holds separate buffers; an all-to-all's tuple is one
                # buffer cut in a chunk per peer.
                size = (
                    sum(parts) if kind == "all_to_all" and sum(parts) >= floor else sum(b for b in parts if b >= floor)
                )
                if base == "ragged-all-to-all":  # the slices sent: at most the smaller of operand and output
                    operands = re.findall(r"(?:(\w+\[[\d,]*\])\S*\s+)?%([\w.-]+)", m.group(3))[:2]
                    size = min(shape_bytes(s or results.get(name, result)) for s, name in operands)
                if kind == "permute":  # the axes any (source, target) pair differs along
                    axes = tuple(a for a in AXES if any(a in axes_of(g) for g in groups))
                else:
                    axes = axes_of(groups[0])
                if axes and size:
                    out[(kind, axes)] = out.get((kind, axes), 0) + size * times
                continue
            if op == "while":
                if LATER_ROUNDS in line:  # a MoE dispatch's later rounds: priced as not run
                    continue
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                body = re.search(r"body=%([\w.-]+)", line)
                if body:
                    visit(body.group(1), times * (int(trip.group(1)) if trip else 1))
                continue
            for callee in re.findall(r"(?:calls|to_apply|branch_computations)=\{?%([\w.-]+)", line):
                if op in ("call", "conditional", "async-start"):
                    visit(callee, times)

    if entry is not None:
        visit(entry, 1)
    return out


# -- links and prices -------------------------------------------------------------------------


def device_ids(sizes: Mapping[str, int]) -> np.ndarray:
    """Device numbers laid out as the mesh: axis order ``AXES``, the last varying fastest."""
    return np.arange(math.prod(sizes[a] for a in AXES)).reshape([sizes[a] for a in AXES])


def spans(sizes: Mapping[str, int], axes: tuple[str, ...], domain: int) -> int:
    """How many fast domains of ``domain`` consecutive devices the widest group of devices that
    differ only along ``axes`` spans (from the mesh's shape: cached, and no device array where the
    whole mesh sits in one domain)."""
    return _layout(tuple(sizes[a] for a in AXES), tuple(AXES.index(a) for a in axes), max(domain, 1))[0]


def fewest_inside(sizes: Mapping[str, int], axes: tuple[str, ...], domain: int) -> int:
    """The fewest devices of one group (devices that differ only along ``axes``) inside one fast
    domain of ``domain`` consecutive devices, over every group and every domain it touches: how
    many of the group's links out of that domain its collectives share."""
    return _layout(tuple(sizes[a] for a in AXES), tuple(AXES.index(a) for a in axes), max(domain, 1))[1]


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], idx: tuple[int, ...], domain: int) -> tuple[int, int]:
    """(domains the widest group spans, fewest of a group's devices inside one domain)."""
    group = math.prod(shape[i] for i in idx)
    if group == 1 or math.prod(shape) <= domain:
        return 1, group
    if domain == 1:
        return group, 1
    # A group's devices are a base plus the offsets along ``axes``; the domains it spans depend
    # on the base only modulo the domain: one group per residue is enough.
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    offsets = np.zeros(1, dtype=np.int64)
    for i in idx:
        offsets = (offsets[:, None] + np.arange(shape[i], dtype=np.int64)[None, :] * strides[i]).reshape(-1)
    rest = [i for i in range(len(shape)) if i not in idx]
    residues = np.zeros(1, dtype=np.int64)
    for i in rest:
        residues = np.unique((residues[:, None] + np.arange(shape[i], dtype=np.int64)[None, :] * strides[i]) % domain)
    counts = [np.unique((r + offsets) // domain, return_counts=True)[1] for r in residues.tolist()]
    return int(max(c.size for c in counts)), int(min(c.min() for c in counts))


def crosses(sizes: Mapping[str, int], axes: tuple[str, ...], domain: int) -> bool:
    """Whether some group of devices that differ only along ``axes`` spans two fast domains of
    ``domain`` consecutive devices."""
    return spans(sizes, axes, domain) > 1


def link(hw: Any, sizes: Mapping[str, int], axes: tuple[str, ...]) -> float:
    """Bytes/s per device per direction a collective over ``axes`` gets on hardware ``hw``; a
    :class:`ConfigError` where the hardware has no figure for the link it needs."""
    across = crosses(sizes, axes, hw.domain)
    bw = hw.cross_link if across else hw.domain_link
    if bw <= 0:
        where = "across its fast domains" if across else "within a fast domain"
        raise ConfigError(
            f"hardware {hw.name!r} has no link figure {where} ({'cross_link' if across else 'domain_link'} is 0): "
            f"a collective over {'x'.join(axes)} cannot be priced"
        )
    return bw


def seconds(kind: str, nbytes: int | float, n: int, bandwidth: int | float) -> float:  # noqa: PYI041
    """A ring collective's time: ``(n-1)/n`` of the buffer through each device (twice for an
    all-reduce: reduce-scatter then all-gather); a permute sends its buffer once."""
    if n <= 1:
        return 0.0
    share = 1.0 if kind == "permute" else (n - 1) / n
    return (2.0 if kind == "all_reduce" else 1.0) * share * nbytes / bandwidth


def collective_seconds(kind: str, nbytes: int | float, hw: Any, sizes: Mapping[str, int],  # noqa: PYI041
                       axes: tuple[str, ...]) -> float:  # fmt: skip
    """A collective of ``kind`` over ``axes`` on hardware ``hw``. Inside one fast domain: one ring
    on ``domain_link``. A group spanning k domains, with at least m of its devices in each:

    - hierarchical hardware (TPU multislice), all-gather / reduce-scatter / all-reduce: a ring
      inside the domain on all the bytes, then one across the k domains on ``1/inside`` of them
      (each slice first gathers the other slices' shards of its share over DCN);
    - GPUs (NCCL), the same three: rings, one per channel, each crossing between domains on
      another device's network link, so the m devices' links carry the crossing bytes together:
      a ring at ``min(domain_link, m x cross_link)`` (the bus bandwidth nccl-tests reports across
      nodes grows with the GPUs per node: NVIDIA/nccl#1168, ~45 -> ~90 GB/s from 4 to 8 GPUs per
      node; #2409 expects ~470 GB/s on 2 x 8 H100 with a 400 Gb/s NIC each);
    - an all-to-all: each device's bytes for the group outside its domain, ``(n-m)/n``, on its
      own ``cross_link``, the rest on ``domain_link`` (at once);
    - a permute: its buffer once, on the link it crosses.
    """
    n = math.prod(sizes[a] for a in axes)
    if n <= 1:
        return 0.0
    bandwidth = link(hw, sizes, axes)
    k = spans(sizes, axes, hw.domain)
    if k == 1 or kind == "permute":
        return seconds(kind, nbytes, n, bandwidth)
    m = fewest_inside(sizes, axes, hw.domain)
    if kind == "all_to_all":
        return max((n - m) / n * nbytes / bandwidth, (m - 1) / n * nbytes / hw.domain_link)
    if not hw.hierarchical:
        return seconds(kind, nbytes, n, min(hw.domain_link, m * bandwidth))
    if n % k:
        return seconds(kind, nbytes, n, bandwidth)
    inside = n // k
    return seconds(kind, nbytes, inside, hw.domain_link) + seconds(kind, nbytes / inside, k, bandwidth)


# -- a step's collectives as the planner prices them ------------------------------------------


def _weight_axes(axes: tuple[str, ...]) -> bool:
    """Whether a gather or reduce-scatter over ``axes`` is FSDP's, of weights: over ``fsdp``
    and the expert group that joins it on the weights outside the experts
    (:data:`zoo.parallel.WEIGHT_SHARDS`; tokens cross the expert group by all-to-all)."""
    return bool(axes) and set(axes) <= set(WEIGHT_SHARDS)


def _weights(c: Collective) -> bool:
    """FSDP's per-layer weight gathers and gradient reduce-scatters: XLA's latency-hiding
    scheduler runs them behind the neighbouring layer's compute."""
    return c.layer and c.overlap and _weight_axes(c.axes) and c.kind in ("all_gather", "reduce_scatter")


@dataclass
class Traffic:
    """A step's collectives as polynomials in the local batch: lines through the traces at local
    batches 1 and ``b2``, or through three traces a parabola (a pipelined step, whose per-tick
    collectives can grow with the micro-batches times the ticks), priced on ``hw`` for the mesh
    ``sizes``: seconds of FSDP weight traffic in the forward and the backward layer loops
    (hidden behind those loops' compute where it fits), and seconds of everything else (tensor
    all-reduces, all-to-alls, context gathers, the gradient all-reduce over the batch axes,
    gathers outside the layer loops, a pipeline's hand-overs and all-reduces), exposed.

    The traces are of GPipe's schedule; :meth:`seconds` and :meth:`bytes` derive the interleaved
    schedule's from them (``scale``: :func:`interleaved`)."""

    lines: dict[tuple[str, tuple[str, ...], str, str], tuple[float, ...]]  # (kind, axes, scope, tick) -> coefficients
    bandwidth: dict[tuple[str, ...], float]
    sizes: dict[str, int]
    prefetch: float  # bytes: one more layer of gathered weights, the scheduler's prefetch buffer
    hw: Any  # the hardware priced on (:func:`collective_seconds`)

    @classmethod
    def of(cls, one: list[Collective], two: list[Collective], b2: int, sizes: Mapping[str, int], hw: Any,
           three: tuple[int, list[Collective]] | None = None) -> Traffic:  # fmt: skip
        """From the collectives traced at local batch 1 (``one``), ``b2`` (``two``) and, where
        given, ``three = (b3, collectives)``."""

        def scope(c: Collective) -> str:
            return ("backward" if c.backward else "forward") if _weights(c) else "exposed"

        def sums(cs: list[Collective]) -> dict:
            out: dict = {}
            for c in cs:
                key = (c.kind, c.axes, scope(c), c.tick)
                out[key] = out.get(key, 0.0) + c.total
            return out

        points = [(1, sums(one)), (b2, sums(two))] + ([(three[0], sums(three[1]))] if three else [])
        xs = np.array([float(b) for b, _ in points])
        if len(set(xs.tolist())) < len(xs):
            raise ConfigError(f"Traffic: the traces' local batches {xs.tolist()} must differ")
        # Coefficients, lowest power first, of the polynomial through the points (exact: as
        # many coefficients as points).
        vander = np.vander(xs, len(xs), increasing=True)
        lines = {}
        for key in set().union(*(s for _, s in points)):
            ys = np.array([s.get(key, 0.0) for _, s in points])
            lines[key] = tuple(float(c) for c in np.linalg.solve(vander, ys))
        bandwidth = {axes: link(hw, sizes, axes) for _, axes, _, _ in lines}
        per_layer: dict[int, float] = {}
        for c in one:
            if _weights(c) and c.kind == "all_gather" and not c.backward:
                per_layer[c.count] = per_layer.get(c.count, 0.0) + c.nbytes
        # The scheduler gathers the next layer while this one computes: two layers' weights live.
        prefetch = 0.0 if hw.unified else max(per_layer.values(), default=0.0)
        return cls(lines, bandwidth, dict(sizes), prefetch, hw)

    @staticmethod
    def _at(coefficients: tuple[float, ...], b: int) -> float:
        return max(sum(c * b**i for i, c in enumerate(coefficients)), 0.0)

    def bytes(self, b: int, kind: str, axes: tuple[str, ...], scale: Mapping[str, float] | None = None) -> float:
        """Per-device bytes per step at local batch ``b`` of the collectives of ``kind`` over ``axes``."""
        scale = scale or {}
        return float(sum(self._at(cs, b) * scale.get(tick, 1.0) for (k, x, _, tick), cs in self.lines.items()
                         if (k, x) == (kind, axes)))  # fmt: skip

    def seconds(self, b: int, scale: Mapping[str, float] | None = None) -> dict[str, float]:
        """Seconds per step at local batch ``b``: ``forward`` and ``backward`` weight traffic,
        ``exposed`` the rest. ``scale``: the interleaved schedule's factor per :attr:`Collective.tick`
        (:func:`interleaved`); there the hoisted forward gathers run in the tick loop, behind its compute."""
        out = {"forward": 0.0, "backward": 0.0, "exposed": 0.0}
        for (kind, axes, where, tick), cs in self.lines.items():
            if scale and tick == "hoisted":
                where = "forward"
            nbytes = self._at(cs, b) * (scale or {}).get(tick, 1.0)
            out[where] += collective_seconds(kind, nbytes, self.hw, self.sizes, axes)
        return out


def interleaved(microbatches: int, stages: int, virtual: int) -> dict[str, float]:
    """How a pipelined step's collectives, traced on GPipe's schedule (``M + P - 1`` ticks, each
    running the stage's ``L/P`` layers), grow on the interleaved schedule's (``V·M + P - 1`` ticks
    of ``L/(P·V)`` layers), per :attr:`Collective.tick`: once per tick (the hand-overs) by the
    ticks; per tick and layer by the layer-ticks; FSDP's hoisted forward gathers, once per layer
    under GPipe, at every tick of its chunk: by ``(V·M + P - 1)/V``. The chunk a tick runs is a
    slice of the stage's layers at an offset the tick picks, so nothing is hoisted out of its loop."""
    gpipe, ticks = microbatches + stages - 1, virtual * microbatches + stages - 1
    return {"tick": ticks / gpipe, "stage": ticks / (virtual * gpipe), "hoisted": ticks / virtual}
