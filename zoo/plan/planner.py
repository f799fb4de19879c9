"""The placement map (and batch) that trains fastest within a device and a host memory budget.

The cost model, per device and per step:

- **compute**: the model's FLOPs (``config.flops_per_token``) plus what the map recomputes
  (:mod:`zoo.plan._flops`: each remat'd name's backward slice in the traced layer), at the
  hardware's bf16 peak times its ``efficiency``;
- **offload**: each layer's offloaded residuals cross the host link once forward, once
  backward; a layer's transfer hides under that layer's compute (forward, or backward and
  recompute) and only what exceeds it adds time;
- **parameters in host memory** come to the device before the forward pass and go back after
  the update (exposed); **optimizer state in host memory** comes in under the passes' compute
  and goes back after the update;
- **the update** reads and writes parameters, gradients and moments at HBM bandwidth.

Memory, per device: the parameters, optimizer state and batch where they live, plus the larger
of the passes' temporaries (gradients, saved residuals, one layer's transient) and the
update's. Two estimates of the full-remat step (:func:`zoo.plan.estimate`, local batch 1 and
2) give the passes' temporaries as a line in the batch; each name's residual bytes are exact
(the traced program's). Every candidate is placed by this model, and the plan is verified by a
full estimate of its own step before it is returned (tightening the budget and searching again
if the estimate disagrees), then by the CUDA export: every offloaded name really moves to host.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from zoo import parallel
from zoo.errors import ConfigError
from zoo.hooks import PIPELINE
from zoo.placement import PlacementMap
from zoo.plan import _flops, collectives
from zoo.plan._step import SDS, Step, layer_stacks, make_step, mesh_spec
from zoo.plan._step import mesh_sizes as _mesh_sizes
from zoo.plan.estimate import Estimate, GiB, _from_step
from zoo.plan.hardware import Hardware
from zoo.plan.hardware import hardware as lookup

TREE_PLACES = ("device", "pinned_host")
# With a pipeline axis, the planner's micro-batches are of one row (Megatron's usual micro-batch
# size): for b rows per device, M = b micro-batches, the fewest bubble ticks ((P - 1) / (b + P - 1))
# and the fewest saved rows (b + P - 1 ticks of one) GPipe allows; what it costs, FSDP's
# re-gathers of the stage's weights at every tick of the backward pass, is priced.
MICROBATCH_ROWS = 1


@dataclass(frozen=True)
class Candidate:
    """One row of the plan's table: a map, where parameters and optimizer state live, the
    largest batch it fits (``None``: none does) and the model's figures at that batch."""

    label: str
    placement: PlacementMap | None
    param_memory: str
    opt_memory: str
    batch_size: int | None
    device_bytes: float
    host_bytes: float
    step_time: float
    mfu: float
    tokens_per_s: float


@dataclass(frozen=True)
class Plan:
    """The fastest map and batch within the budgets, its verified estimate, and the table of
    candidates it was chosen over."""

    placement: PlacementMap
    batch_size: int
    param_memory: str
    opt_memory: str
    step_time: float
    mfu: float
    tokens_per_s: float
    estimate: Estimate
    candidates: tuple[Candidate, ...]
    hardware: Hardware
    device_budget: float
    host_budget: float
    seq_len: int
    mesh: str
    offloaded_verified: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # Seconds per step of collectives not hidden behind compute, and the mesh search's table
    # (each row a mesh's best candidate, the chosen mesh first; empty for a given mesh).
    comm_time: float = 0.0
    meshes: tuple[Any, ...] = ()
    # With a pipeline axis: the micro-batches per device (TrainConfig.microbatches), the bubble's
    # share of the ticks, and per device per step the point-to-point bytes and those all-reduced
    # over the pipeline axis (CostModel.pipeline_bytes); None / 0 without one.
    microbatches: int | None = None
    bubble: float = 0.0
    p2p_bytes: float = 0.0
    pipeline_reduce_bytes: float = 0.0

    @property
    def devices(self) -> int:
        return math.prod(_mesh_sizes(self.mesh or None).values())

    def table(self) -> str:
        """The candidates as an aligned text table (GiB per device; MiB for small models)."""
        return candidate_table(self.candidates)

    def __str__(self) -> str:
        head = (
            f"plan: {self.estimate.model} on {self.hardware.name} x {self.estimate.mesh or 'one device'}, "
            f"{self.seq_len} tokens per sequence; budgets {_size(self.device_budget)} device, "
            f"{_size(self.host_budget)} host per device"
        )
        lines = [head]
        if self.meshes:
            from zoo.plan.search import mesh_table

            lines += [f"meshes of {self.devices} devices, the chosen first:", mesh_table(self.meshes), "",
                      f"the chosen mesh {self.mesh or 'one device'}:"]  # fmt: skip
        lines += [
            self.table(),
            "",
            f"chosen: batch {self.batch_size}, parameters {self.param_memory}, optimizer state {self.opt_memory}",
            f"  map: {self.placement.spec()}",
            (
                f"  estimate (verified): {_size(self.estimate.device_bytes)} device, "
                f"{_size(self.estimate.host_bytes)} host; step {self.step_time:.3g} s (collectives exposed "
                f"{self.comm_time:.3g} s), MFU {self.mfu:.1%}, {self.tokens_per_s / self.devices:.4g} tokens/s per device"
            ),
        ]
        if self.microbatches:
            lines.append(
                f"  pipeline: microbatches={self.microbatches} (TrainConfig.microbatches), bubble {self.bubble:.1%} of "
                f"the ticks; per device per step {_size(self.p2p_bytes)} handed stage to stage, "
                f"{_size(self.pipeline_reduce_bytes)} all-reduced over pipeline"
            )
        if self.offloaded_verified:
            lines.append(f"  offloaded, checked in the CUDA export: {', '.join(self.offloaded_verified)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def candidate_table(candidates: tuple[Candidate, ...] | list[Candidate]) -> str:
    """Candidates as an aligned text table: where parameters and optimizer state live, the
    largest global batch that fits, device and host memory per device at it, step time, MFU
    and tokens per second."""
    big = max((max(c.device_bytes, c.host_bytes) for c in candidates), default=0) >= GiB
    unit, div = ("GiB", GiB) if big else ("MiB", 2**20)
    head = (
        f"{'candidate':<24} {'params/opt':<13} {'batch':>7} {'device ' + unit:>11} {'host ' + unit:>9} "
        f"{'step s':>9} {'MFU':>6} {'tokens/s':>11}"
    )
    rows = [head, "-" * len(head)]
    for c in candidates:
        where = f"{_short(c.param_memory)}/{_short(c.opt_memory)}"
        batch = str(c.batch_size) if c.batch_size else "none"
        rows.append(
            f"{c.label:<24} {where:<13} {batch:>7} {c.device_bytes / div:>11.1f} {c.host_bytes / div:>9.1f} "
            f"{c.step_time:>9.3g} {c.mfu:>6.1%} {c.tokens_per_s:>11.4g}"
        )
    return "\n".join(rows)


def _size(b: int | float) -> str:  # noqa: PYI041  (beartype takes no int for float)
    """Bytes for a message: GiB, or MiB below one GiB."""
    return f"{b / GiB:.1f} GiB" if abs(b) >= GiB else f"{b / 2**20:.1f} MiB"


def _short(place: str) -> str:
    return {"device": "device", "pinned_host": "host"}[place]


# ---------------------------------------------------------------------------------------------
# The cost model
# ---------------------------------------------------------------------------------------------


class _Where:
    """A map as name -> placement: hashable and cheap to change in the search (a
    PlacementMap validates every field on construction)."""

    __slots__ = ("_d", "_key")

    def __init__(self, items: Any) -> None:
        self._d = dict(items)
        self._key = tuple(self._d.items())

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Where) and self._key == other._key

    def __iter__(self):
        return iter(self._key)

    def get(self, name: str, default: str = "device") -> str:
        return self._d.get(name, default)

    @classmethod
    def of(cls, placement: Any) -> _Where | None:
        if placement is None or isinstance(placement, _Where):
            return placement
        return cls(placement.items())

    def replace(self, **changes: str) -> _Where:
        return _Where({**self._d, **changes})

    def placed(self, where: str) -> tuple[str, ...]:
        return tuple(n for n, p in self._key if p == where)


class CostModel:
    """Memory and step time of any map, batch and tree placement, from a few traces.

    With a ``pipeline`` axis of ``P`` stages the traces are of one row per micro-batch
    (``microbatches`` = the local batch ``b``: :data:`MICROBATCH_ROWS`; a third trace, ``third``,
    makes the collectives a parabola in ``b``), so the GPipe schedule
    runs ``b + P - 1`` ticks, each stage's layers on one row per tick; the pipelined layers'
    compute, recompute, offload and saved tensors scale with those ``b + P - 1`` rows (the
    bubble's ticks compute and save as the others do), the head's work is split over the stages
    with the vocabulary, the layers kept whole (DeepSeek-V3's dense-first layers and MTP block)
    run on every stage, and the point-to-point hand-overs and the broadcast of the last stage's
    output are collectives of the traced step, priced on the link the pipeline axis crosses."""

    def __init__(self, base: Step, e1: Estimate, e2: Estimate, jaxpr: Any, hw: Hardware, seq_len: int, b2: int = 2,
                 jaxpr2: Any = None, bodies: list[_flops.Body] | None = None,
                 third: tuple[int, Any] | None = None):  # fmt: skip
        self.base, self.hw, self.seq_len = base, hw, seq_len
        self.stages = base.sizes[PIPELINE]
        if self.stages > 1 and base.microbatches != base.local_batch:
            raise ConfigError(
                f"cost model: a pipeline step is traced at one row per micro-batch (microbatches = the local batch "
                f"{base.local_batch}), got microbatches={base.microbatches}"
            )
        # Collectives at local batches 1 and b2 (the second trace, where given): a line in the batch;
        # with a third trace (b3, jaxpr: a pipeline's), a parabola.
        one = collectives.traced(jaxpr, base.sizes)
        two = collectives.traced(jaxpr2, base.sizes) if jaxpr2 is not None else one
        three = None if third is None else (third[0], collectives.traced(third[1], base.sizes))
        self.traffic = collectives.Traffic.of(one, two, b2 if jaxpr2 is not None else 2, base.sizes, hw, three)
        self.peak = hw.peak_for(base.model.compute_dtype)
        self.map_cls = type(base.model).placement_map
        self.shards = base.batch_size // base.local_batch
        self.params, self.opt = e1.params, e1.optimizer
        self.batch_bytes = seq_len * 4
        # Temporaries of the passes under full remat: a line in the local batch (through 1 and b2).
        self.passes_slope = max(e2.passes - e1.passes, 0) / max(b2 - 1, 1)
        self.passes_base = e1.passes - self.passes_slope
        self.update = max(e1.update, e2.update)
        fields = set(self.map_cls.names())
        self.stacks = [s for s in layer_stacks(jaxpr) if set(s.names) & fields]
        # Per name: bytes per unit of local batch (per_b) and fixed (per_0) over every stack. A
        # pipelined stack saves b + P - 1 ticks of one row (the bubble's ticks too), and the
        # backward pass's tick reads its tick's saved tensors, the stage's layers of one row, as
        # a copied slice (the liveness walk's rule for a scan's slice a matmul reads): P rows fixed.
        self.per_b: dict[str, float] = collections.Counter()
        self.per_0: dict[str, float] = collections.Counter()
        for st in self.stacks:
            for n, (count, shape) in st.names.items():
                if n in fields:
                    nb = float(st.length * count * math.prod(shape.shape) * jnp.dtype(shape.dtype).itemsize)
                    self.per_b[n] += nb  # traced at one row (per micro-batch)
                    if st.pipelined:
                        self.per_0[n] += nb * self.stages
        self.names = [n for n in self.map_cls.names() if self.per_b.get(n)]
        remat = self.map_cls.preset("remat")
        self.base_device = {n for n in self.names if getattr(remat, n) == "device"}
        self.bodies = _flops.layer_bodies(base.model, seq_len) if bodies is None else bodies
        self.tensor = base.sizes["tensor"]
        self.flops_model = base.config.flops_per_token(seq_len) * seq_len / (base.devices / self.shards)
        # ^ per device per unit local batch: the global batch's FLOPs shared by every device
        self.can_offload = hw.host_link > 0 and not hw.unified
        self._times: dict[tuple, tuple[float, float]] = {}
        self.comm: dict[tuple, float] = {}  # (map, batch, pm, om) -> exposed collective seconds
        self._stack_for = {id(b): self._stack_of(b) for b in self.bodies}
        # A sequence's training FLOPs (3 x forward) in the pipelined layers, in the layers kept
        # whole (run on every stage), and outside the layers (the head, split over the stages
        # with the vocabulary where zoo.vocab_parallel splits it over them; else on every stage).
        self.pipelined_flops = sum(3 * b.forward_flops() * b.layers for b in self.bodies if self._pipelined(b))
        self.whole_flops = sum(3 * b.forward_flops() * b.layers for b in self.bodies if not self._pipelined(b))
        per_sequence = self.flops_model * base.devices / self.shards
        self.head_flops = max(per_sequence - self.pipelined_flops - self.whole_flops, 0.0)
        vocab = parallel.vocab_split_of(base.model, base.mesh) if self.stages > 1 else None
        self.head_stages = vocab.stages if vocab is not None and vocab.stage_axis == PIPELINE else 1

    # -- the pipeline ------------------------------------------------------------------------
    def _pipelined(self, body: _flops.Body) -> bool:
        st = self._stack_for[id(body)]
        return st is not None and st.pipelined

    def _work(self, body: _flops.Body, b: int) -> tuple[int, int]:
        """(layers, rows) of ``body`` one device runs per step at local batch ``b``: a pipelined
        stack's stage (its layers split over the stages, padding included) on ``b + P - 1`` rows,
        one per tick; any other stack whole on ``b`` rows."""
        if self._pipelined(body):
            return -(-body.layers // self.stages), b + MICROBATCH_ROWS * (self.stages - 1)
        return body.layers, b

    def microbatches(self, b: int) -> int | None:
        """The micro-batches of a pipelined step at local batch ``b`` (None without a pipeline)."""
        return b // MICROBATCH_ROWS if self.stages > 1 else None

    def bubble(self, b: int) -> float:
        """The GPipe bubble's share of the pipelined layers' ticks at local batch ``b``."""
        if self.stages == 1:
            return 0.0
        from zoo.pipeline import bubble

        return bubble(self.stages, self.microbatches(b))

    def pipeline_bytes(self, b: int) -> tuple[float, float]:
        """Per device per step at local batch ``b``: (point-to-point bytes the stages hand on,
        bytes all-reduced over the pipeline axis: the last stage's output broadcast, the backward
        pass's per-tick sum of the fed micro-batch's gradient and, with the vocabulary split over
        the stages, the embedding's lookups and the head's feature gradients summed)."""
        return self.traffic.bytes(b, "permute", (PIPELINE,)), self.traffic.bytes(b, "all_reduce", (PIPELINE,))

    def compute_flops(self, b: int) -> float:
        """The model's FLOPs one device runs per step at local batch ``b`` (recomputation not
        included): its share of the global batch's where nothing is pipelined; pipelined, its
        stage's layers on ``b + P - 1`` rows (the bubble's ticks compute too, masked: the
        pipelined layers' share times ``(M + P - 1) / M``), the head's share of the stages, and
        the layers kept whole (DeepSeek-V3's dense-first layers and MTP block) on every stage."""
        if self.stages == 1:
            return self.flops_model * b
        split = self.base.devices / self.shards / self.stages  # tensor x context
        stages = sum(3 * body.forward_flops() * math.prod(self._work(body, b)) for body in self.bodies
                     if self._pipelined(body))  # fmt: skip
        return (self.head_flops / self.head_stages * b + self.whole_flops * b + stages) / split

    # -- memory ------------------------------------------------------------------------
    def _named(self, placement: Any, where: str, b: int) -> float:
        return float(sum(self.per_b[n] * b + self.per_0[n] for n in self.names if placement.get(n) == where))

    def memory(self, placement: Any, b: int, pm: str, om: str) -> tuple[float, float]:
        """(device, host) bytes per device at local batch ``b``."""
        placement = _Where.of(placement)
        base = sum(self.per_b[n] * b + self.per_0[n] for n in self.base_device)
        if placement is None:  # no map: XLA keeps at least every named tensor
            extra = sum(self.per_b[n] * b + self.per_0[n] for n in self.names) - base
            host_res = 0.0
        else:
            extra = self._named(placement, "device", b) - base
            host_res = self._named(placement, "pinned_host", b)
        passes = self.passes_base + self.passes_slope * b + extra
        p_host, o_host = pm == "pinned_host", om == "pinned_host"
        temps = max(passes + p_host * self.params, self.update + p_host * self.params + o_host * self.opt)
        device = (not p_host) * self.params + (not o_host) * self.opt + self.batch_bytes * b + temps
        device += self.traffic.prefetch
        host = p_host * self.params + o_host * self.opt + host_res
        return float(device), float(host)

    # -- time ------------------------------------------------------------------------------
    def _stack_of(self, body: _flops.Body) -> Any:
        """The traced stack a layer body runs in: one of its length sharing its names, else the
        pipeline's tick loop sharing the most of them."""
        for st in self.stacks:
            if not st.pipelined and st.length == body.layers and body.names & set(st.names):
                return st
        shared = [(len(body.names & set(st.names)), i) for i, st in enumerate(self.stacks) if st.pipelined]
        best = max(shared, default=(0, -1))
        return self.stacks[best[1]] if best[0] else None

    def time(self, placement: Any, b: int, pm: str, om: str) -> tuple[float, float]:
        """(step seconds, model FLOPs per device) at local batch ``b``."""
        placement = _Where.of(placement)
        key = (placement, b, pm, om)
        if key not in self._times:
            self._times[key] = self._time(placement, b, pm, om)
        return self._times[key]

    def _time(self, placement: Any, b: int, pm: str, om: str) -> tuple[float, float]:
        rate = self.peak * self.hw.efficiency
        model = self.flops_model * b
        executed = self.compute_flops(b)
        recompute = exposed = 0.0
        layer_fwd = layer_bwd = 0.0  # the layer loops' compute, seconds: what hides FSDP's traffic
        for body in self.bodies:
            layers, rows = self._work(body, b)
            fwd = body.forward_flops() * rows / self.tensor
            remat = () if placement is None else [n for n in body.names if placement.get(n) == "remat"]
            rec = body.recompute_flops(remat) * rows / self.tensor
            recompute += layers * rec
            layer_fwd += layers * fwd / rate
            layer_bwd += layers * (2 * fwd + rec) / rate
            if placement is None or not self.can_offload:
                continue
            st = self._stack_for[id(body)]
            moved = 0.0
            if st is not None:
                for n, (count, shape) in st.names.items():
                    if placement.get(n) == "pinned_host":
                        moved += count * math.prod(shape.shape) * jnp.dtype(shape.dtype).itemsize * rows
            link = moved / self.hw.host_link
            exposed += layers * (max(0.0, link - fwd / rate) + max(0.0, link - (2 * fwd + rec) / rate))
        compute = (executed + recompute) / rate
        comm = self.traffic.seconds(b)
        # XLA's latency-hiding scheduler gathers the next layer's weights (and scatters the last
        # layer's gradients) behind this layer's compute; tensor all-reduces, all-to-alls and
        # what runs outside the layer loops wait on their results.
        hidden = max(0.0, comm["forward"] - layer_fwd) + max(0.0, comm["backward"] - layer_bwd)
        t = compute + exposed + hidden + comm["exposed"]
        self.comm[(placement, b, pm, om)] = hidden + comm["exposed"]
        if self.can_offload or self.hw.unified:
            bw = self.hw.host_link if self.hw.host_link > 0 else math.inf
            if pm == "pinned_host":
                t += 2 * self.params / bw
            if om == "pinned_host":
                t += max(0.0, self.opt / bw - compute) + self.opt / bw
        t += (3 * self.params + 2 * self.opt) / self.hw.hbm_bandwidth
        return t, model

    def with_efficiency(self, efficiency: float) -> CostModel:
        """This model on the same traces with the hardware's matmul ``efficiency`` replaced
        (a calibration tries many without tracing again)."""
        other = copy.copy(self)
        other.hw = dataclasses.replace(self.hw, efficiency=float(efficiency))
        other._times, other.comm = {}, {}
        return other

    # -- search ----------------------------------------------------------------------------
    def choices(self, name: str) -> tuple[str, ...]:
        out = [c for c in self.map_cls.choices(name) if c != "pinned_host" or self.can_offload]
        return tuple(out)

    def search(self, b: int, pm: str, om: str, device_budget: float, host_budget: float) -> PlacementMap | None:
        """Greedy: from everything on device, move the name whose move costs the least time per
        device byte it frees, until the step fits; then move back what still fits faster."""
        m = _Where.of(self.map_cls.preset("device"))

        def fits(p):
            d, h = self.memory(p, b, pm, om)
            return d <= device_budget and h <= host_budget

        def cost(p):
            return self.time(p, b, pm, om)[0]

        while True:
            d, h = self.memory(m, b, pm, om)
            if d <= device_budget and h <= host_budget:
                break
            best, t0 = None, cost(m)
            for n in self.names:
                if m.get(n) != "device":
                    continue
                for c in self.choices(n):
                    if c == "device":
                        continue
                    cand = m.replace(**{n: c})
                    d2, h2 = self.memory(cand, b, pm, om)
                    if h2 > host_budget or d2 >= d:
                        continue
                    score = (cost(cand) - t0) / (d - d2)
                    if best is None or score < best[0] - 1e-18 or (abs(score - best[0]) <= 1e-18 and d2 < best[2]):
                        best = (score, cand, d2)
            if best is None:
                return None
            m = best[1]
        improved = True
        while improved:  # undo moves that the budget no longer needs, or swap remat <-> host
            improved = False
            for n in self.names:
                for c in self.choices(n):
                    if c == m.get(n):
                        continue
                    cand = m.replace(**{n: c})
                    if fits(cand) and cost(cand) < cost(m) * (1 - 1e-9):
                        m, improved = cand, True
        return self.map_cls(**dict(m))

    def min_memory(self, b: int, pm: str, om: str) -> PlacementMap:
        """The least device memory map: every name remat'd, or offloaded where that is all it takes."""
        m = self.map_cls.preset("remat")
        if self.can_offload and "pinned_host" in self.map_cls.choices("layer_input"):
            m = dataclasses.replace(m, layer_input="pinned_host")
        return m


# ---------------------------------------------------------------------------------------------
# Verifying offloads in the CUDA export
# ---------------------------------------------------------------------------------------------

_FUNC = re.compile(r"^(\s*)func\.func (?:public|private) @([\w.$-]+)\(")
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call @([\w.$-]+)\(")
_ANNOTATE = re.compile(r'@annotate_device_placement\(.*_xla_buffer_placement = "(\w+)".*: \((tensor<[^>]*>)\) ->')


def _host_moves(mlir: str) -> collections.Counter:
    """``(placement, tensor type)`` of every ``annotate_device_placement`` the program runs from
    ``main``, through its calls (as ``tests/test_placement.py`` counts them)."""
    lines = mlir.splitlines()

    def close(start: int) -> int:
        ind = len(lines[start]) - len(lines[start].lstrip())
        return next(i for i in range(start + 1, len(lines))
                    if len(lines[i]) - len(lines[i].lstrip()) == ind and lines[i].lstrip().startswith("}"))  # fmt: skip

    funcs = {m.group(2): (i, close(i)) for i, line in enumerate(lines) if (m := _FUNC.match(line))}

    @functools.cache
    def in_func(name: str) -> collections.Counter:
        a, b = funcs[name]
        found: collections.Counter = collections.Counter()
        for line in lines[a + 1 : b]:
            if m := _ANNOTATE.search(line):
                found[m.groups()] += 1
            for callee in _CALL.findall(line):
                if callee in funcs:
                    found += in_func(callee)
        return found

    return in_func("main")


def _tensor_type(s: Any) -> str:
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32"}[jnp.dtype(s.dtype).name]
    return f"tensor<{'x'.join(map(str, s.shape))}x{short}>"


def verify_offloads(model: Any, placement: PlacementMap, seq_len: int) -> tuple[str, ...]:
    """The offloaded names, each checked to move to pinned host memory in the CUDA export of
    one sequence's forward and backward pass; a ConfigError names any that does not."""
    import equinox as eqx

    offloaded = placement.placed("pinned_host")
    if not offloaded:
        return ()
    ids = SDS((1, seq_len), jnp.int32)

    def f(m, x):
        return eqx.filter_value_and_grad(lambda m: m.loss(x, placement=placement)[0])(m)

    shapes: dict[str, Any] = {}
    counts: collections.Counter = collections.Counter()
    from zoo.placement import named_tensors

    for name, s in named_tensors(lambda m, x: m.loss(x, placement=placement)[0], model, ids):
        shapes.setdefault(name, s)
        counts[name] += 1
    mlir = jax.export.export(jax.jit(f), platforms=["cuda"])(model, ids).mlir_module()
    moves = _host_moves(mlir)
    to_host = collections.Counter({t: n for (where, t), n in moves.items() if where == "pinned_host"})
    need: collections.Counter = collections.Counter()
    for name in offloaded:
        if name in shapes:
            need[_tensor_type(shapes[name])] += 1
    missing = [n for n in offloaded if n in shapes and to_host[_tensor_type(shapes[n])] < need[_tensor_type(shapes[n])]]
    if missing:
        raise ConfigError(f"the plan offloads {missing} but the CUDA export moves no such tensor to pinned host memory")
    return tuple(n for n in offloaded if n in shapes)


# ---------------------------------------------------------------------------------------------
# plan()
# ---------------------------------------------------------------------------------------------


def plan(
    model_or_config: Any,
    *,
    seq_len: int,
    device_budget: int | float | None = None,  # noqa: PYI041  (beartype takes no int for float)
    batch_size: int | None = None,
    host_budget: int | float | None = None,  # noqa: PYI041
    mesh: Any = None,
    hardware: str | Hardware | None = None,
    compute_dtype: Any = None,
    verify: bool = True,
    margin: float = 0.1,
    devices: int | None = None,
    top: int = 5,
    pipeline: bool = True,
) -> Plan:
    """The placement map, parameter and optimizer-state memory, and (``batch_size=None``) the
    largest global batch that maximise estimated tokens per second within ``device_budget``
    and ``host_budget`` bytes per device (default: the hardware's HBM and host memory).

    ``devices`` without ``mesh``: the mesh too, searched over zoo's axes
    (:func:`zoo.plan.search.search`: every mesh of ``devices`` that divides the model, pruned by
    memory, the ``top`` most promising planned in full; ``pipeline=False``: no pipeline axis);
    the plan's ``meshes`` hold the table.
    ``hardware``: a name of :data:`zoo.plan.hardware.HARDWARE` (default ``"cpu"``, one memory:
    nothing is offloaded). ``margin``: the fraction of each budget kept free for the
    estimate's own error (10% is the worst measured against XLA:CPU on the test grid). Raises :class:`~zoo.errors.MeshError` for a mesh that does not divide
    the model or the batch, :class:`~zoo.errors.ConfigError` for an unknown hardware name or a
    budget nothing fits (naming the smallest peak found and what dominates it).
    """
    if devices is not None:
        from zoo.plan import search

        if not isinstance(devices, int) or devices < 1:
            raise ConfigError(f"plan: devices must be a positive integer, got {devices!r}")
        if mesh is None:
            return search.search(model_or_config, devices=devices, seq_len=seq_len, device_budget=device_budget,
                                 batch_size=batch_size, host_budget=host_budget, hardware=hardware,
                                 compute_dtype=compute_dtype, verify=verify, margin=margin, top=top,
                                 pipeline=pipeline)  # fmt: skip
        n = math.prod(_mesh_sizes(mesh).values())
        if n != devices:
            raise ConfigError(f"plan: mesh {mesh_spec(_mesh_sizes(mesh))} has {n} devices, not devices={devices}")
    return plan_mesh(model_or_config, seq_len=seq_len, device_budget=device_budget, batch_size=batch_size,
                     host_budget=host_budget, mesh=mesh, hardware=hardware, compute_dtype=compute_dtype,
                     verify=verify, margin=margin)  # fmt: skip


def plan_mesh(
    model_or_config: Any,
    *,
    seq_len: int,
    device_budget: int | float | None = None,  # noqa: PYI041
    batch_size: int | None = None,
    host_budget: int | float | None = None,  # noqa: PYI041
    mesh: Any = None,
    hardware: str | Hardware | None = None,
    compute_dtype: Any = None,
    verify: bool = True,
    margin: float = 0.1,
    bodies: list[_flops.Body] | None = None,
) -> Plan:
    """:func:`plan` on one given mesh; ``bodies``: the layer bodies' FLOP counts, where a
    search already has them (they depend on the model and the sequence, not the mesh)."""
    hw = lookup(hardware if hardware is not None else "cpu")
    device_budget = float(hw.hbm_bytes if device_budget is None else device_budget)
    host_budget = float(hw.host_bytes if host_budget is None else host_budget)
    if hw.unified:
        host_budget = 0.0
    probe = make_step(model_or_config, batch_size=_shards(mesh), seq_len=seq_len, placement="remat", mesh=mesh,
                      compute_dtype=compute_dtype, microbatches=MICROBATCH_ROWS)  # fmt: skip
    shards = probe.batch_size
    if batch_size is not None and batch_size % shards:
        from zoo.errors import MeshError

        raise MeshError(
            f"batch size {batch_size} is not divisible by the mesh's batch axes ({shards} devices split it)"
        )
    j1 = probe.trace()
    e1 = _from_step(probe, unified=hw.unified, jaxpr=j1)
    # The second point of the line: the requested batch itself, where one is given.
    second = batch_size // shards if batch_size is not None and batch_size > shards else 2
    probe2 = make_step(probe.model, batch_size=second * shards, seq_len=seq_len, placement="remat", mesh=mesh,
                       microbatches=second // MICROBATCH_ROWS)  # fmt: skip
    j2 = probe2.trace()
    e2 = _from_step(probe2, unified=hw.unified, jaxpr=j2)
    cm = CostModel(probe, e1, e2, j1, hw, seq_len, second, jaxpr2=j2, bodies=bodies,
                   third=_third_trace(probe, second, seq_len, mesh))  # fmt: skip

    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ConfigError(f"plan: margin is the fraction of each budget kept free, in [0, 1); got {margin!r}")
    usable = (device_budget * (1 - margin), host_budget * (1 - margin))
    budgets = usable
    best, fixed_b = None, None if batch_size is None else batch_size // shards
    for attempt in range(3):
        best = _choose(cm, fixed_b, *budgets)
        if best is None:
            _nothing_fits(cm, e1, fixed_b, device_budget, host_budget)
        placement, b, pm, om = best
        step = make_step(probe.model, batch_size=b * shards, seq_len=seq_len, placement=placement, mesh=mesh,
                         param_memory=pm, opt_memory=om, microbatches=cm.microbatches(b))  # fmt: skip
        est = _from_step(step, unified=hw.unified)
        if est.device_bytes <= usable[0] and est.host_bytes <= usable[1]:
            break
        # The model was optimistic for this candidate: search again with the budgets less its miss.
        d, h = cm.memory(placement, b, pm, om)
        budgets = (budgets[0] - max(est.device_bytes - d, 0.0) - 1.0, budgets[1] - max(est.host_bytes - h, 0.0) - 1.0)
    else:
        _nothing_fits(cm, e1, fixed_b, device_budget, host_budget)
    placement, b, pm, om = best
    t, flops = cm.time(placement, b, pm, om)
    verified = verify_offloads(probe.model, placement, seq_len) if verify and cm.can_offload else ()
    candidates = _candidates(cm, fixed_b, device_budget, host_budget, (placement, b, pm, om))
    return Plan(
        placement=placement, batch_size=b * shards, param_memory=pm, opt_memory=om, step_time=t,
        mfu=flops / (t * cm.peak), tokens_per_s=b * shards * seq_len / t, estimate=est,
        candidates=candidates, hardware=hw, device_budget=device_budget, host_budget=host_budget,
        seq_len=seq_len, mesh=mesh_spec(probe.sizes), offloaded_verified=verified,
        notes=tuple(n for n in (hw.note,) if n), comm_time=cm.comm[(_Where.of(placement), b, pm, om)],
        microbatches=cm.microbatches(b), bubble=cm.bubble(b), p2p_bytes=cm.pipeline_bytes(b)[0],
        pipeline_reduce_bytes=cm.pipeline_bytes(b)[1],
    )  # fmt: skip


def price(
    model_or_config: Any,
    placements: dict[str, Any],
    *,
    seq_len: int,
    batch_size: int,
    mesh: Any = None,
    hardware: str | Hardware | None = None,
    param_memory: str = "device",
    opt_memory: str = "device",
    compute_dtype: Any = None,
) -> tuple[Candidate, ...]:
    """The cost model's figures for given maps (label -> map, spec string or None) at one
    global batch: memory per device, step time, MFU, tokens per second; ``batch_size`` of a
    row is ``None`` where it exceeds the hardware's memory. What ``plan`` weighs, for any map."""
    hw = lookup(hardware if hardware is not None else "cpu")
    cm = cost_model(model_or_config, seq_len=seq_len, mesh=mesh, hardware=hw, compute_dtype=compute_dtype)
    probe, shards = cm.base, cm.shards
    from zoo.placement import resolve

    b = batch_size // shards
    out = []
    for label, m in placements.items():
        m = None if m is None else resolve(m, probe.model)
        t, flops = cm.time(m, b, param_memory, opt_memory)
        d, h = cm.memory(m, b, param_memory, opt_memory)
        fits = d <= hw.hbm_bytes and h <= hw.host_bytes
        out.append(Candidate(label, m, param_memory, opt_memory, batch_size if fits else None, d, h, t,
                             flops / (t * cm.peak), batch_size * seq_len / t))  # fmt: skip
    return tuple(out)


def cost_model(
    model_or_config: Any, *, seq_len: int, mesh: Any = None, hardware: str | Hardware | None = None,
    compute_dtype: Any = None,
) -> CostModel:
    """The cost model of one model, sequence, mesh and hardware, from the full-remat step traced
    at local batches 1 and 2: what :func:`price` prices maps with (``zoo.plan.published`` too)."""
    hw = lookup(hardware if hardware is not None else "cpu")
    shards = _shards(mesh)
    probe = make_step(model_or_config, batch_size=shards, seq_len=seq_len, placement="remat", mesh=mesh,
                      compute_dtype=compute_dtype, microbatches=MICROBATCH_ROWS)  # fmt: skip
    j1 = probe.trace()
    e1 = _from_step(probe, unified=hw.unified, jaxpr=j1)
    probe2 = make_step(probe.model, batch_size=2 * shards, seq_len=seq_len, placement="remat", mesh=mesh,
                       microbatches=2 // MICROBATCH_ROWS)  # fmt: skip
    j2 = probe2.trace()
    e2 = _from_step(probe2, unified=hw.unified, jaxpr=j2)
    return CostModel(probe, e1, e2, j1, hw, seq_len, 2, jaxpr2=j2, third=_third_trace(probe, 2, seq_len, mesh))


def _third_trace(probe: Step, second: int, seq_len: int, mesh: Any) -> tuple[int, Any] | None:
    """A pipelined step traced at a third local batch: its collectives per tick may grow with
    the micro-batches (the batch) times the ticks, a parabola in the batch (None without a pipeline)."""
    if probe.stages == 1:
        return None
    b3 = second + 1
    step = make_step(probe.model, batch_size=b3 * probe.batch_size, seq_len=seq_len, placement="remat", mesh=mesh,
                     microbatches=b3 // MICROBATCH_ROWS)  # fmt: skip
    return b3, step.trace()


def _shards(mesh: Any) -> int:
    """The devices one global batch is split over."""
    from zoo.parallel import BATCH_AXES
    from zoo.plan._step import mesh_sizes

    sizes = mesh_sizes(mesh)
    return math.prod(sizes[a] for a in BATCH_AXES)


def _batches(cm: CostModel, fixed_b: int | None, device_budget: float, host_budget: float) -> list[int]:
    """Local batches worth evaluating: the given one, or 1 up to the largest any map fits."""
    if fixed_b is not None:
        return [fixed_b]
    top = 0
    b = 1
    while b <= 1 << 20:
        if not any(_fits(cm, cm.min_memory(b, pm, om), b, pm, om, device_budget, host_budget)
                   for pm in TREE_PLACES for om in TREE_PLACES):  # fmt: skip
            break
        top, b = b, b * 2
    if top == 0:
        return []
    lo, hi = top, 2 * top  # the largest fitting local batch lies in [top, 2 top)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if any(_fits(cm, cm.min_memory(mid, pm, om), mid, pm, om, device_budget, host_budget)
               for pm in TREE_PLACES for om in TREE_PLACES):  # fmt: skip
            lo = mid
        else:
            hi = mid
    if lo <= 32:
        return list(range(1, lo + 1))
    grid = {lo, *range(max(1, lo - 8), lo)}
    x = 1
    while x < lo:
        grid.update((x, x + x // 2))
        x *= 2
    return sorted(g for g in grid if g <= lo)


def _fits(cm: CostModel, placement: Any, b: int, pm: str, om: str, device_budget: float, host_budget: float) -> bool:
    if not cm.can_offload and (pm != "device" or om != "device"):
        return False
    d, h = cm.memory(placement, b, pm, om)
    return d <= device_budget and h <= host_budget


def _choose(cm: CostModel, fixed_b: int | None, device_budget: float, host_budget: float):
    best = None
    for b in _batches(cm, fixed_b, device_budget, host_budget):
        for pm in TREE_PLACES:
            for om in TREE_PLACES:
                if not cm.can_offload and (pm != "device" or om != "device"):
                    continue
                m = cm.search(b, pm, om, device_budget, host_budget)
                if m is None:
                    continue
                t, _ = cm.time(m, b, pm, om)
                rate = b / t
                if best is None or rate > best[0] * (1 + 1e-9):
                    best = (rate, (m, b, pm, om))
    return None if best is None else best[1]


def _candidates(cm: CostModel, fixed_b, device_budget, host_budget, chosen=None) -> tuple[Candidate, ...]:
    P = cm.map_cls
    rows: list[tuple[str, Any]] = [("no map", None), ("full remat", P.preset("remat"))]
    rows += [(f"preset {name}", P.preset(name)) for name in P.preset_names() if name != "remat"]
    out = []
    for label, m in rows:
        out.append(_candidate(cm, label, m, fixed_b, device_budget, host_budget))
    if chosen is None:
        return tuple(out)
    placement, b, pm, om = chosen
    t, flops = cm.time(placement, b, pm, om)
    d, h = cm.memory(placement, b, pm, om)
    out.append(Candidate("plan", placement, pm, om, b * cm.shards, d, h, t, flops / (t * cm.peak),
                         b * cm.shards * cm.seq_len / t))  # fmt: skip
    return tuple(out)


def _candidate(cm: CostModel, label: str, m: Any, fixed_b, device_budget, host_budget) -> Candidate:
    best = None
    for pm in TREE_PLACES:
        for om in TREE_PLACES:
            if not cm.can_offload and (pm != "device" or om != "device"):
                continue
            if m is not None and not cm.can_offload and m.placed("pinned_host"):
                continue
            b = _largest(cm, m, pm, om, fixed_b, device_budget, host_budget)
            if b:
                t, _ = cm.time(m, b, pm, om)
                key = (b, -t)
                if best is None or key > best[0]:
                    best = (key, b, pm, om)
    if best is None:
        b, pm, om = fixed_b or 1, "device", "device"
        fits = None
    else:
        _, b, pm, om = best
        fits = b * cm.shards
    t, flops = cm.time(m, b, pm, om)
    d, h = cm.memory(m, b, pm, om)
    return Candidate(label, m, pm, om, fits, d, h, t, flops / (t * cm.peak), b * cm.shards * cm.seq_len / t)


def _largest(cm, m, pm, om, fixed_b, device_budget, host_budget) -> int:
    if fixed_b is not None:
        return fixed_b if _fits(cm, m, fixed_b, pm, om, device_budget, host_budget) else 0
    if not _fits(cm, m, 1, pm, om, device_budget, host_budget):
        return 0
    lo, hi = 1, 2
    while _fits(cm, m, hi, pm, om, device_budget, host_budget) and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(cm, m, mid, pm, om, device_budget, host_budget) else (lo, mid)
    return lo


class NothingFits(ConfigError):
    """No map, batch and placement of parameters and optimizer state fits the budgets;
    ``candidates``: the table, each row at the smallest batch."""

    candidates: tuple[Candidate, ...] = ()


def _nothing_fits(cm: CostModel, e1: Estimate, fixed_b: int | None, device_budget: float, host_budget: float) -> None:
    b = fixed_b or 1
    best = None
    for pm in TREE_PLACES:
        for om in TREE_PLACES:
            if not cm.can_offload and (pm != "device" or om != "device"):
                continue
            m = cm.min_memory(b, pm, om)
            d, h = cm.memory(m, b, pm, om)
            miss = max(0.0, d - device_budget) + max(0.0, h - host_budget)
            if best is None or miss < best[0]:
                best = (miss, d, h, pm, om)
    _, d, h, pm, om = best
    parts = {
        "parameters": e1.params * (pm == "device"),
        "optimizer state": e1.optimizer * (om == "device"),
        "gradients": e1.params,
        "the saved layer inputs and one layer's transient": cm.passes_base + cm.passes_slope * b - e1.params,
    }
    top = max(parts, key=parts.get)
    activations = top == "the saved layer inputs and one layer's transient"
    advice = "use shorter sequences or more devices" if activations else "shard it over more devices (fsdp, expert)"
    error = NothingFits(
        f"nothing fits: the smallest peak found is {_size(d)} device and {_size(h)} host per device "
        f"(local batch {b}, full remat{' and offload' if cm.can_offload else ''}, parameters {pm}, optimizer state "
        f"{om}) against budgets of {_size(device_budget)} device and {_size(host_budget)} host; the largest part "
        f"is {top} ({_size(parts[top])}): " + advice
    )
    error.candidates = _candidates(cm, fixed_b, device_budget, host_budget)
    raise error
