"""The planner's cost model: memory and step time of any map, batch and tree placement, from a few traces.

Per device and per step:

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
(the traced program's). :mod:`zoo.plan.mesh_plan` searches maps and batches with it, :mod:`zoo.plan.search` meshes.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zoo import lora, parallel
from zoo.core.mesh import PIPELINE, chunk_size, virtual_fits
from zoo.core.params import path_name
from zoo.errors import ConfigError
from zoo.hardware import Hardware
from zoo.hooks.pipeline import STACK_TOTAL, bubble
from zoo.placement import PlacementMap, placement_map_for
from zoo.plan import _flops, collectives
from zoo.plan._step import SDS, Step, layer_stacks, mesh_spec
from zoo.plan.estimate import Estimate
from zoo.plan.jaxprs import has_scope
from zoo.plan.meshes import pipelined_layers

# With a pipeline axis, the planner's micro-batches are of one row (Megatron's usual micro-batch
# size): for b rows per device, M = b micro-batches, the fewest bubble ticks ((P - 1) / (b + P - 1))
# and the fewest saved rows (b + P - 1 ticks of one) GPipe allows; what it costs, FSDP's
# re-gathers of the stage's weights at every tick of the backward pass, is priced.
MICROBATCH_ROWS = 1


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
    output are collectives of the traced step, priced on the link the pipeline axis crosses.

    The interleaved schedule (``virtual`` stages ``V > 1``, each device's layers in ``V`` chunks)
    is derived from those GPipe traces, not traced (each ``V`` would take three more traces): its
    ``V·b + P - 1`` ticks each run a chunk of ``L/(P·V)`` layers on one row (compute, recompute,
    offload and saved tensors of ``b + (P - 1)/V`` rows of the stage's layers), the collectives
    grow as :func:`zoo.plan.collectives.interleaved` says, and GPipe's hoisted copy of the
    stage's weights is not made (:meth:`interleaved_bytes`).

    The 1F1B schedule (:attr:`schedule`, :meth:`with_schedule`; interleaved or not) is derived from
    the same traces: the same ticks' compute and hand-overs, every tick's forward pass gathering
    its layers (no hoisted copy, as interleaved), a tick's gradient of the stage's weights before it
    joins the sum (:meth:`interleaved_bytes`), and the pipelined layers' saved tensors kept for
    at most ``2·V·P - 1`` chunks of one row (:func:`zoo.parallel.one_f_one_b.ring_slots`, a slot
    more for the stages with no forward pass at a tick, and the backward pass's copy of its slot)
    instead of ``b + (P - 1)/V`` rows, those of the layers before the stack for at most ``2P`` rows.
    A loss that takes a total of what the stack computes (:func:`zoo.hooks.pipeline.stack_total`:
    Qwen3-MoE's expert loads) makes 1F1B run the stack's forward pass over the whole batch first,
    as GPipe runs it (:attr:`whole_pass`): its compute and its weight gathers are priced; its other
    collectives (MoE all-to-alls, tensor all-reduces: the traces do not split those by pass) are not."""

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
        self.map_cls = placement_map_for(base.model)
        self.shards = base.batch_size // base.local_batch
        self.params, self.opt = e1.params, e1.optimizer
        # Of the parameters, what the layer scan brings to the device a layer at a time where they
        # wait in host memory (a LoRA run's frozen base stacks, a quantized base), and one layer of it.
        self.streamed, self.streamed_layer = _streamed(base)
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
            for n, nbytes in st.names.items():
                if n in fields:
                    nb = float(st.length * nbytes)
                    self.per_b[n] += nb  # traced at one row (per micro-batch)
                    if st.pipelined:
                        self.per_0[n] += nb * self.stages
        self.names = [n for n in self.map_cls.names() if self.per_b.get(n)]
        remat = self.map_cls.preset("remat")
        self.base_device = {n for n in self.names if getattr(remat, n) == "device"}
        self.bodies = _flops.layer_bodies(base.model, seq_len, base.precision) if bodies is None else bodies
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
        # FP8 products (the precision map's tensorwise matmuls, forward and both gradients) run at
        # the hardware's FP8 peak: a body's compute takes ``_flops.fp8_slowdown`` of its time at the compute
        # dtype's peak; the step's, by the FP8 products' share of all its FLOPs.
        # MXFP8's block-scaled products count among them where the hardware runs those at its FP8 peak.
        self.fp8_ratio = hw.peak_for(jnp.float8_e4m3fn) / self.peak
        self.fp8_share = _flops.fp8_share(self.bodies, per_sequence, hw.block_scaled_fp8)
        vocab = parallel.vocab_split_of(base.model, base.mesh) if self.stages > 1 else None
        self.head_stages = vocab.stages if vocab is not None and vocab.stage_axis == PIPELINE else 1
        self.stage_weights, self.hoisted = _stage_weights(base) if self.stages > 1 else (0.0, 0.0)
        self.schedule = "gpipe"  # or "1f1b": with_schedule
        self.whole_pass = has_scope(jaxpr, STACK_TOTAL)  # 1F1B runs the stack forward once more

    def batch_limit(self) -> int:
        """The largest local batch a plan considers: on 1F1B, whose memory stops growing with the
        micro-batches, ``16·P`` micro-batches (a bubble under 1/16; Megatron-Bridge's DeepSeek-V3
        run has 16 per stage); else any that fits."""
        return 16 * self.stages * MICROBATCH_ROWS if self.schedule == "1f1b" else 1 << 20

    def with_schedule(self, schedule: str) -> CostModel:
        """This model on the same traces priced on another pipeline ``schedule`` ("gpipe" or "1f1b")."""
        if schedule not in ("gpipe", "1f1b"):
            raise ConfigError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
        other = copy.copy(self)
        other.schedule = schedule if self.stages > 1 else "gpipe"
        other._times, other.comm = {}, {}
        return other

    # -- the pipeline ------------------------------------------------------------------------
    def _pipelined(self, body: _flops.Body) -> bool:
        st = self._stack_for[id(body)]
        return st is not None and st.pipelined

    def _work(self, body: _flops.Body, b: int, virtual: int = 1) -> tuple[int, int]:
        """(layers, rows) of ``body`` one device runs per step at local batch ``b``: a pipelined
        stack's stage (its layers split over the stages, padding included) on ``b + P - 1`` rows,
        one per tick; any other stack whole on ``b`` rows. Interleaved (``virtual`` chunks), a
        chunk of the stage on each of ``V·b + P - 1`` rows."""
        if self._pipelined(body):
            return chunk_size(-(-body.layers // self.stages), virtual), virtual * b + MICROBATCH_ROWS * (self.stages - 1)
        return body.layers, b

    def virtual_stages(self, b: int) -> list[int]:
        """The interleaved schedule's virtual stages a pipelined step at local batch ``b`` may run
        (:func:`virtual_choices`; ``[1]`` without a pipeline)."""
        return virtual_choices(self.base.config, self.stages, self.microbatches(b)) if self.stages > 1 else [1]

    def check_virtual(self, b: int, virtual: int) -> None:
        """A :class:`ConfigError` naming the rule where ``virtual`` stages cannot run at local batch ``b``."""
        if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1:
            raise ConfigError(f"virtual_stages must be a positive integer, got {virtual!r}")
        if virtual > 1 and self.stages == 1:
            mesh = mesh_spec(self.base.sizes) or "one device"
            raise ConfigError(f"virtual_stages={virtual} needs a pipeline axis; the mesh {mesh!r} has none")
        if virtual not in self.virtual_stages(b):
            raise ConfigError(
                f"virtual_stages={virtual} cannot run at {b} rows per device on pipeline={self.stages}: the "
                f"interleaved schedule needs the micro-batches (here {self.microbatches(b)}, one row each) a "
                f"multiple of the stages and each stage's layers in virtual_stages chunks, none empty; possible here: "
                f"{self.virtual_stages(b)}"
            )

    def microbatches(self, b: int) -> int | None:
        """The micro-batches of a pipelined step at local batch ``b`` (None without a pipeline)."""
        return b // MICROBATCH_ROWS if self.stages > 1 else None

    def bubble(self, b: int, virtual: int = 1) -> float:
        """The bubble's share of the pipelined layers' ticks at local batch ``b`` (GPipe's, or the
        interleaved schedule's with ``virtual`` stages)."""
        if self.stages == 1:
            return 0.0
        return bubble(self.stages, self.microbatches(b), virtual)

    def _scale(self, b: int, virtual: int) -> dict[str, float] | None:
        """The interleaved schedule's factors on the traced collectives (None for GPipe's)."""
        if virtual == 1 and self.schedule == "gpipe":
            return None
        # 1F1B's forward passes gather their layers at every tick, as the interleaved schedule's do.
        return collectives.interleaved(self.microbatches(b), self.stages, virtual)

    def pipeline_bytes(self, b: int, virtual: int = 1) -> tuple[float, float]:
        """Per device per step at local batch ``b``: (point-to-point bytes the stages hand on,
        bytes all-reduced over the pipeline axis: the last stage's output broadcast, the backward
        pass's per-tick sum of the fed micro-batch's gradient and, with the vocabulary split over
        the stages, the embedding's lookups and the head's feature gradients summed)."""
        scale = self._scale(b, virtual)
        return (self.traffic.bytes(b, "permute", (PIPELINE,), scale),
                self.traffic.bytes(b, "all_reduce", (PIPELINE,), scale))  # fmt: skip

    def interleaved_bytes(self, b: int, virtual: int) -> float:
        """Device bytes the interleaved schedule adds to GPipe's at local batch ``b``: GPipe's copy
        of the stage's weights in the compute dtype, its forward gathers hoisted out of the tick
        loop, is not made (each tick picks its chunk's layers inside the layer's checkpoint, and
        the backward pass picks them again: :func:`zoo.layers.stack.scan_layers`), so a negative
        figure (measured on XLA:CPU: ``tests/test_plan_pipeline.py``)."""
        if self.schedule == "1f1b" and virtual == 1:
            # No hoisted copy; but each backward pass's gradient of the stage's weights is a buffer
            # of its own before it is added to the sum, and the sum is zeros XLA allocates before
            # the tick loop (XLA:CPU's buffer assignment: one f32 stacked gradient per weight,
            # live from the step's start across the loop; tests/test_plan_pipeline.py, where the
            # walk of the traced step is within 0.3% of XLA). Interleaved, the chunk's gradient
            # is added into the sum where it is picked.
            return 2 * self.stage_weights - self.hoisted
        return 0.0 if virtual == 1 else -self.hoisted

    def compute_flops(self, b: int, virtual: int = 1) -> float:
        """The model's FLOPs one device runs per step at local batch ``b`` (recomputation not
        included): its share of the global batch's where nothing is pipelined; pipelined, its
        stage's layers on ``b + P - 1`` rows (the bubble's ticks compute too, masked: the
        pipelined layers' share times ``(M + P - 1) / M``), the head's share of the stages, and
        the layers kept whole (DeepSeek-V3's dense-first layers and MTP block) on every stage.
        Interleaved, ``(V·M + P - 1) / (V·M)`` times the pipelined layers' share. On 1F1B with
        :attr:`whole_pass`, the stage's layers once more forward (4 passes, not 3)."""
        if self.stages == 1:
            return self.flops_model * b
        split = self.base.devices / self.shards / self.stages  # tensor x context
        passes = 4 if self.schedule == "1f1b" and self.whole_pass else 3
        stages = sum(passes * body.forward_flops() * math.prod(self._work(body, b, virtual)) for body in self.bodies
                     if self._pipelined(body))  # fmt: skip
        return (self.head_flops / self.head_stages * b + self.whole_flops * b + stages) / split

    # -- memory ------------------------------------------------------------------------
    def _rows_kept(self, n: str, b: int, virtual: int) -> float:
        """Bytes of name ``n`` the pipelined and other layers keep at local batch ``b``."""
        if self.schedule == "gpipe":  # interleaved, the bubble's ticks and the copied slice are of a chunk: per_0 / V
            return self.per_b[n] * b + self.per_0[n] / virtual
        # 1F1B: a ring of chunk items of one row, a slot more, and the backward pass's copy of one;
        # the layers before the stack (DeepSeek-V3's dense ones) per micro-batch, in a ring of 2P.
        pipelined = self.per_0[n] / self.stages
        items = min(virtual * self.microbatches(b), 2 * virtual * self.stages - 1) + 2
        return (self.per_b[n] - pipelined) * min(b, 2 * self.stages) + pipelined * items / virtual

    def _named(self, placement: Any, where: str, b: int, virtual: int = 1) -> float:
        return float(sum(self._rows_kept(n, b, virtual) for n in self.names
                         if placement is None or placement.get(n) == where))  # fmt: skip

    def memory(self, placement: Any, b: int, pm: str, om: str, virtual: int = 1) -> tuple[float, float]:
        """(device, host) bytes per device at local batch ``b`` (``virtual``: the interleaved schedule's)."""
        placement = _Where.of(placement)
        # GPipe's other buffers per row (the micro-batches' inputs and outputs, their gradients, the
        # head's) are, on 1F1B, those of the micro-batches in flight: at most 2P of one row.
        rows = b if self.schedule == "gpipe" else min(b, 2 * self.stages)
        # In the traced (GPipe) passes at those rows: replaced by what the map keeps on the schedule priced.
        base = sum(self.per_b[n] * rows + self.per_0[n] for n in self.base_device)
        # No map: XLA keeps at least every named tensor.
        extra = self._named(placement, "device", b, virtual) - base
        host_res = 0.0 if placement is None else self._named(placement, "pinned_host", b, virtual)
        passes = self.passes_base + self.passes_slope * rows + extra + self.interleaved_bytes(b, virtual)
        p_host, o_host = pm == "pinned_host", om == "pinned_host"
        brought = p_host * (self.params - self.streamed + self.streamed_layer)  # what the step brings over
        temps = max(passes + brought, self.update + brought + o_host * self.opt)
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

    def time(self, placement: Any, b: int, pm: str, om: str, virtual: int = 1) -> tuple[float, float]:
        """(step seconds, model FLOPs per device) at local batch ``b`` (``virtual``: the interleaved
        schedule's; ``comm`` keeps its exposed collectives under ``(map, b, pm, om)``, ``V > 1``
        appended)."""
        placement = _Where.of(placement)
        key = (placement, b, pm, om) + ((virtual,) if virtual != 1 else ())
        if key not in self._times:
            self._times[key] = self._time(placement, b, pm, om, virtual, key)
        return self._times[key]

    def _time(self, placement: Any, b: int, pm: str, om: str, virtual: int, key: tuple) -> tuple[float, float]:
        rate = self.peak * self.hw.efficiency
        model = self.flops_model * b
        executed = self.compute_flops(b, virtual)
        recompute = exposed = 0.0
        layer_fwd = layer_bwd = 0.0  # the layer loops' compute, seconds: what hides FSDP's traffic
        whole_fwd = 0.0  # 1F1B's forward pass over the whole batch first (whole_pass), seconds
        for body in self.bodies:
            layers, rows = self._work(body, b, virtual)
            slow = _flops.fp8_slowdown(body.fp8_share(self.hw.block_scaled_fp8), self.fp8_ratio)
            fwd = body.forward_flops() * rows / self.tensor * slow  # in FLOPs at the compute dtype's rate
            remat = () if placement is None else [n for n in body.names if placement.get(n) == "remat"]
            rec = body.recompute_flops(remat) * rows / self.tensor * slow
            recompute += layers * rec
            layer_fwd += layers * fwd / rate
            layer_bwd += layers * (2 * fwd + rec) / rate
            if self._pipelined(body):
                whole_fwd += layers * fwd / rate
            if placement is None or not self.can_offload:
                continue
            st = self._stack_for[id(body)]
            moved = 0.0
            if st is not None:
                for n, nbytes in st.names.items():
                    if placement.get(n) == "pinned_host":
                        moved += nbytes * rows
            link = moved / self.hw.host_link
            exposed += layers * (max(0.0, link - fwd / rate) + max(0.0, link - (2 * fwd + rec) / rate))
        compute = (executed * _flops.fp8_slowdown(self.fp8_share, self.fp8_ratio) + recompute) / rate
        comm = self.traffic.seconds(b, self._scale(b, virtual))
        # XLA's latency-hiding scheduler gathers the next layer's weights (and scatters the last
        # layer's gradients) behind this layer's compute; tensor all-reduces, all-to-alls and
        # what runs outside the layer loops wait on their results.
        hidden = max(0.0, comm["forward"] - layer_fwd) + max(0.0, comm["backward"] - layer_bwd)
        if self.schedule == "1f1b" and self.whole_pass:  # GPipe's forward gathers, behind its compute
            gpipe = self.traffic.seconds(b, collectives.interleaved(self.microbatches(b), self.stages, virtual)
                                         if virtual > 1 else None)  # fmt: skip
            hidden += max(0.0, gpipe["forward"] - whole_fwd)
        t = compute + exposed + hidden + comm["exposed"]
        self.comm[key] = hidden + comm["exposed"]
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

    def search(self, b: int, pm: str, om: str, device_budget: float, host_budget: float,
               virtual: int = 1) -> PlacementMap | None:  # fmt: skip
        """Greedy: from everything on device, move the name whose move costs the least time per
        device byte it frees, until the step fits; then move back what still fits faster."""
        m = _Where.of(self.map_cls.preset("device"))

        def fits(p):
            d, h = self.memory(p, b, pm, om, virtual)
            return d <= device_budget and h <= host_budget

        def cost(p):
            return self.time(p, b, pm, om, virtual)[0]

        while True:
            d, h = self.memory(m, b, pm, om, virtual)
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
                    d2, h2 = self.memory(cand, b, pm, om, virtual)
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


def virtual_choices(config: Any, stages: int, microbatches: int) -> list[int]:
    """1 (GPipe), and each ``V > 1`` that splits every pipelined stack's layers per stage
    (padding included; a stack of no layers, Qwen3-MoE's dense one where every layer is MoE,
    aside) into chunks, none empty (:func:`zoo.core.mesh.virtual_fits`: the last may be short),
    where the micro-batches are a multiple of the ``stages`` (:func:`zoo.pipeline.pipelined_scan`'s rules)."""
    per_stage = [-(-n // stages) for n in pipelined_layers(config) if n > 0]
    if not per_stage or microbatches % stages:
        return [1]
    return [v for v in range(1, min(per_stage) + 1) if all(virtual_fits(n, v) for n in per_stage)]


def _streamed(step: Step) -> tuple[float, float]:
    """(bytes per device of the parameters that stay in host memory through a step that keeps
    them there, the layer scan bringing a layer's at a time: :func:`zoo.lora.place_unstreamed`;
    one layer of each such stack, added up: an upper bound of what is over at once)."""
    kept = lora.place_unstreamed(step.params, lambda x: None)  # the streamed leaves, None elsewhere
    leaves = jax.tree.leaves(kept, is_leaf=lambda x: isinstance(x, SDS))
    specs = jax.tree.leaves(step.specs(kept), is_leaf=lambda s: isinstance(s, PartitionSpec))
    held = [math.prod(x.shape) * jnp.dtype(x.dtype).itemsize / step.divisor(s) for x, s in zip(leaves, specs, strict=True)]
    return float(sum(held)), float(sum(h / max(x.shape[0], 1) for h, x in zip(held, leaves) if x.shape))


def _stage_weights(step: Step) -> tuple[float, float]:
    """(bytes of the pipelined stacks' parameters one device holds, as stored: the stage's share;
    the same in the compute dtype and gathered over ``fsdp``: GPipe's hoisted forward gathers)."""
    described = type(step.model).param_specs(step.config)
    rules = type(step.config).axis_rules
    compute = jnp.dtype(step.model.compute_dtype).itemsize
    stored = gathered = 0.0
    for path, x in jax.tree_util.tree_leaves_with_path(step.params, is_leaf=lambda x: isinstance(x, SDS)):
        p = described[path_name(path)]
        axes = parallel.param_axes(p, step.mesh, rules=rules, sizes=step.config.sizes)
        if not (p.names and p.names[0] in p.stacked and axes and axes[0] == PIPELINE):
            continue
        held = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize / step.divisor(PartitionSpec(*axes))
        fsdp = math.prod(step.sizes[a] for g in parallel.gather_axes(p, axes, rules=rules) for a in g)
        stored += held
        gathered += held * fsdp * compute / jnp.dtype(x.dtype).itemsize
    return stored, gathered
