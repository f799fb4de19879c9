"""The placement map (and batch) that trains fastest on one mesh, within a device and a host memory budget.

Every candidate map, batch and placement of parameters and optimizer state is priced by the
cost model (:mod:`zoo.plan.costs`), the fastest that fits is chosen, and the plan is verified
by a full estimate of its own step before it is returned (tightening the budget and searching
again if the estimate disagrees), then by the CUDA export (:mod:`zoo.plan.offloads`): every
offloaded name really moves to host. The plan and its table are :mod:`zoo.plan.plans`'s;
:func:`zoo.plan.plan` (:mod:`zoo.plan.planner`) plans here on a given mesh, or over the meshes
the search (:mod:`zoo.plan.search`) tries.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

from zoo.errors import ConfigError, MeshError
from zoo.hardware import Hardware
from zoo.hardware import hardware as lookup
from zoo.layers.moe_dispatch import target_platform
from zoo.parallel import BATCH_AXES
from zoo.placement import resolve
from zoo.plan import _flops
from zoo.plan._step import Step, make_step, mesh_sizes, mesh_spec
from zoo.plan.costs import MICROBATCH_ROWS, CostModel, _Where
from zoo.plan.estimate import Estimate, _from_step
from zoo.plan.offloads import verify_offloads
from zoo.plan.plans import Candidate, Plan, _size

TREE_PLACES = ("device", "pinned_host")
# A pipelined plan takes the fewest virtual stages whose step is within this fraction of the
# fastest's: each more adds hand-overs (2 (V·M + P - 1) of them) for less bubble, and the cost
# model's figures are not finer than that.
VIRTUAL_TOLERANCE = 0.01
SCHEDULES = ("gpipe", "1f1b")  # a pipelined step's schedules (TrainConfig.schedule)

_F = TypeVar("_F", bound=Callable[..., Any])


def _traced_for_hardware(fn: _F) -> _F:
    """``fn`` traces its steps as they run on its ``hardware``'s platform (the MoE dispatch's
    transport: ragged on GPU and TPU), not on this machine's."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        hw = lookup(kwargs.get("hardware") if kwargs.get("hardware") is not None else "cpu")
        with target_platform(hw.platform):
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


@_traced_for_hardware
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
    precision: Any = None,
    verify: bool = True,
    margin: float = 0.1,
    bodies: list[_flops.Body] | None = None,
    virtual_stages: int | None = None,
    schedule: str | None = None,
) -> Plan:
    """:func:`zoo.plan.plan` on one given mesh; ``bodies``: the layer bodies' FLOP counts, where a
    search already has them (they depend on the model and the sequence, not the mesh)."""
    if schedule not in (None, *SCHEDULES):
        raise ConfigError(f"plan: schedule must be one of {SCHEDULES} or None (searched), got {schedule!r}")
    check_inputs(device_budget=device_budget, host_budget=host_budget, batch_size=batch_size)
    hw = lookup(hardware if hardware is not None else "cpu")
    devices = math.prod(mesh_sizes(mesh).values())
    device_budget = float(hw.memory_per_device(devices) if device_budget is None else device_budget)
    host_budget = float(hw.host_bytes if host_budget is None else host_budget)
    if hw.unified:
        host_budget = 0.0
    probe = make_step(model_or_config, batch_size=_shards(mesh), seq_len=seq_len, placement="remat", mesh=mesh,
                      compute_dtype=compute_dtype, microbatches=MICROBATCH_ROWS, precision=precision)  # fmt: skip
    shards = probe.batch_size
    if batch_size is not None and batch_size % shards:
        raise MeshError(
            f"batch size {batch_size} is not divisible by the mesh's batch axes ({shards} devices split it)"
        )
    j1 = probe.trace()
    e1 = _from_step(probe, unified=hw.unified, jaxpr=j1)
    # The second point of the line: the requested batch itself, where one is given.
    second = batch_size // shards if batch_size is not None and batch_size > shards else 2
    probe2 = make_step(probe.model, batch_size=second * shards, seq_len=seq_len, placement="remat", mesh=mesh,
                       microbatches=second // MICROBATCH_ROWS, precision=probe.precision)  # fmt: skip
    j2 = probe2.trace()
    e2 = _from_step(probe2, unified=hw.unified, jaxpr=j2)
    cm = CostModel(probe, e1, e2, j1, hw, seq_len, second, jaxpr2=j2, bodies=bodies,
                   third=_third_trace(probe, second, seq_len, mesh))  # fmt: skip

    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ConfigError(f"plan: margin is the fraction of each budget kept free, in [0, 1); got {margin!r}")
    usable = (device_budget * (1 - margin), host_budget * (1 - margin))
    budgets = usable
    best, fixed_b = None, None if batch_size is None else batch_size // shards
    _check_virtual(cm, fixed_b, virtual_stages)
    # Each schedule priced from the same traces (1F1B's derived: CostModel.with_schedule), with
    # budgets of its own for GPipe's candidates and for the searched ones (interleaved included):
    # a step derived from GPipe's traces, not traced (with FSDP inside the stages it keeps up to
    # ~8% more than the cost model says, on XLA:CPU), lowers only its own budgets where it misses.
    schedules = (schedule,) if schedule is not None else ("gpipe", "1f1b") if cm.stages > 1 else ("gpipe",)
    models = {s: cm.with_schedule(s) for s in schedules}
    budgets = {(s, kind): usable for s in schedules for kind in ("searched", "gpipe")}
    missed: tuple = ()  # the last choice whose traced estimate exceeded the budgets
    for attempt in range(4):
        choices = []
        for s in schedules:
            own = budgets[s, "gpipe"] != budgets[s, "searched"] and virtual_stages is None
            for c in (_choose(models[s], fixed_b, *budgets[s, "searched"], virtual_stages),
                      _choose(models[s], fixed_b, *budgets[s, "gpipe"], 1) if own else None):  # fmt: skip
                if c is not None:
                    choices.append((*c, s))
        if not choices:
            if missed:  # not the budgets: the cost model's earlier choices failed their own trace
                _unverified(models[missed[-1]], fixed_b, usable, *missed[:-1])
            _nothing_fits(cm, e1, fixed_b, device_budget, host_budget, usable)
        # Tokens per second; GPipe first where they tie (its forward passes gather their layers once).
        best = max(choices, key=lambda c: (c[1] / models[c[5]].time(*c[:5])[0], c[5] == "gpipe"))
        placement, b, pm, om, v, s = best
        step = make_step(probe.model, batch_size=b * shards, seq_len=seq_len, placement=placement, mesh=mesh,
                         param_memory=pm, opt_memory=om, microbatches=cm.microbatches(b),
                         virtual_stages=v, schedule=s, precision=probe.precision)  # fmt: skip
        est = _from_step(step, unified=hw.unified)
        if est.device_bytes <= usable[0] and est.host_bytes <= usable[1]:
            break
        # The model was optimistic for this candidate: search again with the budgets less its miss.
        d, h = models[s].memory(placement, b, pm, om, v)
        missed = (b, d, h, est, s)
        miss = (max(est.device_bytes - d, 0.0) + 1.0, max(est.host_bytes - h, 0.0) + 1.0)
        for kind in ("searched", "gpipe") if v == 1 else ("searched",):
            budgets[s, kind] = (budgets[s, kind][0] - miss[0], budgets[s, kind][1] - miss[1])
    else:
        _unverified(models[missed[-1]], fixed_b, usable, *missed[:-1])
    placement, b, pm, om, v, s = best
    cm = models[s]
    t, flops = cm.time(placement, b, pm, om, v)
    verified = verify_offloads(probe.model, placement, seq_len) if verify and cm.can_offload else ()
    # The table's rows fit the budgets the plan was chosen within (less the margin): at the full
    # budgets a preset's larger batch showed faster than the plan and was never in reach.
    # With the batch and the virtual stages both given, the presets' rows run that schedule too.
    row_v = virtual_stages if virtual_stages is not None and fixed_b is not None else 1
    candidates = _candidates(cm, fixed_b, *usable, best[:5], virtual=row_v)
    key = (_Where.of(placement), b, pm, om) + ((v,) if v != 1 else ())
    return Plan(
        placement=placement, batch_size=b * shards, param_memory=pm, opt_memory=om, step_time=t,
        mfu=flops / (t * cm.peak), tokens_per_s=b * shards * seq_len / t, estimate=est,
        candidates=candidates, hardware=hw, device_budget=device_budget, host_budget=host_budget,
        seq_len=seq_len, mesh=mesh_spec(probe.sizes), offloaded_verified=verified,
        notes=tuple(n for n in (hw.note, _precision_note(cm, flops / t)) if n), comm_time=cm.comm[key],
        microbatches=cm.microbatches(b), bubble=cm.bubble(b, v), p2p_bytes=cm.pipeline_bytes(b, v)[0],
        pipeline_reduce_bytes=cm.pipeline_bytes(b, v)[1], virtual_stages=v, schedule=s,
    )  # fmt: skip


def _precision_note(cm: CostModel, flops_per_s: float) -> str:
    """What a precision map changed in the price ("" without FP8 products)."""
    if cm.base.precision is None:
        return ""
    hw = cm.hw
    mx = "mxfp8" in cm.base.precision.recipes().values()
    block = ("" if not mx else " (MXFP8's block-scaled ones included)" if hw.block_scaled_fp8
             else f" (MXFP8's not: {hw.name} has no block-scaled FP8 products, so they run dequantized)")  # fmt: skip
    return (
        f"precision {cm.base.precision.spec()}: {cm.fp8_share:.1%} of the step's model FLOPs are FP8 products{block}, "
        f"priced at {cm.peak * cm.fp8_ratio / 1e12:.0f} TFLOP/s ({hw.fp8_source or 'no FP8 peak known: as the compute dtype'}); "
        f"{flops_per_s / 1e12:.0f} model TFLOP/s per device, MFU against the compute dtype's peak; the memory "
        "estimate is the FP8 step's (a kept FP8 GEMM input is its FP8 copy)"
    )


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
    precision: Any = None,
    virtual_stages: int = 1,
) -> tuple[Candidate, ...]:
    """The cost model's figures for given maps (label -> map, spec string or None) at one
    global batch: memory per device, step time, MFU, tokens per second; ``batch_size`` of a
    row is ``None`` where it exceeds the hardware's memory. What ``plan`` weighs, for any map
    (with a pipeline axis, on the schedule of ``virtual_stages``: 1 is GPipe's)."""
    hw = lookup(hardware if hardware is not None else "cpu")
    cm = cost_model(model_or_config, seq_len=seq_len, mesh=mesh, hardware=hw, compute_dtype=compute_dtype,
                    precision=precision)
    probe, shards = cm.base, cm.shards
    b = batch_size // shards
    cm.check_virtual(b, virtual_stages)
    out = []
    for label, m in placements.items():
        m = None if m is None else resolve(m, probe.model)
        t, flops = cm.time(m, b, param_memory, opt_memory, virtual_stages)
        d, h = cm.memory(m, b, param_memory, opt_memory, virtual_stages)
        fits = d <= hw.memory_per_device(math.prod(probe.sizes.values())) and h <= hw.host_bytes
        out.append(Candidate(label, m, param_memory, opt_memory, batch_size if fits else None, d, h, t,
                             flops / (t * cm.peak), batch_size * seq_len / t, virtual_stages))  # fmt: skip
    return tuple(out)


@_traced_for_hardware
def cost_model(
    model_or_config: Any,
    *,
    seq_len: int,
    mesh: Any = None,
    hardware: str | Hardware | None = None,
    compute_dtype: Any = None,
    precision: Any = None,
) -> CostModel:
    """The cost model of one model, sequence, mesh and hardware, from the full-remat step traced
    at local batches 1 and 2: what :func:`price` prices maps with (``zoo.plan.published`` too)."""
    hw = lookup(hardware if hardware is not None else "cpu")
    shards = _shards(mesh)
    probe = make_step(model_or_config, batch_size=shards, seq_len=seq_len, placement="remat", mesh=mesh,
                      compute_dtype=compute_dtype, microbatches=MICROBATCH_ROWS, precision=precision)  # fmt: skip
    j1 = probe.trace()
    e1 = _from_step(probe, unified=hw.unified, jaxpr=j1)
    probe2 = make_step(probe.model, batch_size=2 * shards, seq_len=seq_len, placement="remat", mesh=mesh,
                       microbatches=2 // MICROBATCH_ROWS, precision=probe.precision)  # fmt: skip
    j2 = probe2.trace()
    e2 = _from_step(probe2, unified=hw.unified, jaxpr=j2)
    return CostModel(probe, e1, e2, j1, hw, seq_len, 2, jaxpr2=j2, third=_third_trace(probe, 2, seq_len, mesh))


def check_inputs(*, device_budget: Any = None, host_budget: Any = None, batch_size: Any = None) -> None:
    """A one-line :class:`ConfigError` naming the argument where a budget is not a positive finite
    number of bytes (the host budget may be 0: nothing offloaded) or the batch not a positive integer."""
    for name, value, least in (("device_budget", device_budget, 0.0), ("host_budget", host_budget, None)):
        if value is None:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (least is not None and value <= least):
            kind = "a positive" if least is not None else "a non-negative"
            raise ConfigError(f"plan: {name} must be {kind} finite number of bytes per device, got {value!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"plan: batch_size must be a positive integer, got {batch_size!r}")


def _third_trace(probe: Step, second: int, seq_len: int, mesh: Any) -> tuple[int, Any] | None:
    """A pipelined step traced at a third local batch: its collectives per tick may grow with
    the micro-batches (the batch) times the ticks, a parabola in the batch (None without a pipeline)."""
    if probe.stages == 1:
        return None
    b3 = second + 1
    step = make_step(probe.model, batch_size=b3 * probe.batch_size, seq_len=seq_len, placement="remat", mesh=mesh,
                     microbatches=b3 // MICROBATCH_ROWS, precision=probe.precision)  # fmt: skip
    return b3, step.trace()


def _shards(mesh: Any) -> int:
    """The devices one global batch is split over."""
    sizes = mesh_sizes(mesh)
    return math.prod(sizes[a] for a in BATCH_AXES)


def _virtuals(cm: CostModel, b: int, fixed: int | None) -> list[int]:
    """The virtual stages worth pricing at local batch ``b``: those the schedule allows, or the given one."""
    allowed = cm.virtual_stages(b)
    return allowed if fixed is None else [fixed] if fixed in allowed else []


def _check_virtual(cm: CostModel, fixed_b: int | None, virtual: int | None) -> None:
    """A :class:`ConfigError` naming the rule a given ``virtual_stages`` breaks (None: searched)."""
    if virtual is not None:
        cm.check_virtual(fixed_b if fixed_b is not None else cm.stages, virtual)


def _batches(cm: CostModel, fixed_b: int | None, device_budget: float, host_budget: float,
             virtual: int | None = None) -> list[int]:  # fmt: skip
    """Local batches worth evaluating: the given one, or 1 up to the largest any map fits (with
    a given ``virtual`` > 1, multiples of the stages: the interleaved schedule's micro-batches)."""
    if fixed_b is not None:
        return [fixed_b]
    unit = cm.stages if virtual is not None and virtual > 1 else 1

    def fits(b: int) -> bool:
        return any(_fits(cm, cm.min_memory(b, pm, om), b, pm, om, device_budget, host_budget, v)
                   for pm in TREE_PLACES for om in TREE_PLACES for v in _virtuals(cm, b, virtual))  # fmt: skip

    top, k = 0, 1
    while k * unit <= cm.batch_limit():
        if not fits(k * unit):
            break
        top, k = k, k * 2
    if top == 0:
        return []
    lo, hi = top, 2 * top  # the largest fitting local batch lies in [top, 2 top) units
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * unit) else (lo, mid)
    if lo <= 32:
        grid = set(range(1, lo + 1))
    else:
        grid = {lo, *range(max(1, lo - 8), lo)}
        x = 1
        while x < lo:
            grid.update((x, x + x // 2))
            x *= 2
    grid = {g * unit for g in grid if g <= lo}
    # With a pipeline, the interleaved schedule's batches too: multiples of the stages.
    grid |= {g - g % cm.stages for g in grid if g >= cm.stages}
    return sorted(grid)


def _fits(cm: CostModel, placement: Any, b: int, pm: str, om: str, device_budget: float, host_budget: float,
          virtual: int = 1) -> bool:  # fmt: skip
    if not cm.can_offload and (pm != "device" or om != "device"):
        return False
    d, h = cm.memory(placement, b, pm, om, virtual)
    return d <= device_budget and h <= host_budget


def _choose(cm: CostModel, fixed_b: int | None, device_budget: float, host_budget: float, virtual: int | None = None):
    """The fastest (map, local batch, parameter and optimizer-state memory, virtual stages) that
    fits, by rows per second; of those within VIRTUAL_TOLERANCE of it, the fewest virtual stages."""
    found = []  # (rate, V, candidate), in search order
    for b in _batches(cm, fixed_b, device_budget, host_budget, virtual):
        for pm in TREE_PLACES:
            for om in TREE_PLACES:
                if not cm.can_offload and (pm != "device" or om != "device"):
                    continue
                for v in _virtuals(cm, b, virtual):
                    m = cm.search(b, pm, om, device_budget, host_budget, v)
                    if m is None:
                        continue
                    t, _ = cm.time(m, b, pm, om, v)
                    found.append((b / t, v, (m, b, pm, om, v)))
    if not found:
        return None
    fastest = max(rate for rate, _, _ in found)
    fewest = min(v for rate, v, _ in found if rate >= fastest * (1 - VIRTUAL_TOLERANCE))
    best = None
    for rate, v, candidate in found:
        if v == fewest and (best is None or rate > best[0] * (1 + 1e-9)):
            best = (rate, candidate)
    return best[1]


def _candidates(cm: CostModel, fixed_b, device_budget, host_budget, chosen=None, virtual: int = 1) -> tuple[Candidate, ...]:
    P = cm.map_cls
    rows: list[tuple[str, Any]] = [("no map", None), ("full remat", P.preset("remat"))]
    rows += [(f"preset {name}", P.preset(name)) for name in P.preset_names() if name != "remat"]
    out = []
    for label, m in rows:
        out.append(_candidate(cm, label, m, fixed_b, device_budget, host_budget, virtual))
    if chosen is None:
        return tuple(out)
    placement, b, pm, om, v = chosen
    t, flops = cm.time(placement, b, pm, om, v)
    d, h = cm.memory(placement, b, pm, om, v)
    out.append(Candidate("plan", placement, pm, om, b * cm.shards, d, h, t, flops / (t * cm.peak),
                         b * cm.shards * cm.seq_len / t, v))  # fmt: skip
    return tuple(out)


def _candidate(cm: CostModel, label: str, m: Any, fixed_b, device_budget, host_budget, virtual: int = 1) -> Candidate:
    """A map's row: its largest batch that fits (or the given one) at its best tree places, on
    ``virtual`` stages (1: GPipe's order, or 1F1B's V = 1)."""
    best = None
    for pm in TREE_PLACES:
        for om in TREE_PLACES:
            if not cm.can_offload and (pm != "device" or om != "device"):
                continue
            if m is not None and not cm.can_offload and m.placed("pinned_host"):
                continue
            b = _largest(cm, m, pm, om, fixed_b, device_budget, host_budget, virtual)
            if b:
                t, _ = cm.time(m, b, pm, om, virtual)
                key = (b, -t)
                if best is None or key > best[0]:
                    best = (key, b, pm, om)
    if best is None:
        b, pm, om = fixed_b or 1, "device", "device"
        fits = None
    else:
        _, b, pm, om = best
        fits = b * cm.shards
    t, flops = cm.time(m, b, pm, om, virtual)
    d, h = cm.memory(m, b, pm, om, virtual)
    return Candidate(label, m, pm, om, fits, d, h, t, flops / (t * cm.peak), b * cm.shards * cm.seq_len / t, virtual)


def _largest(cm, m, pm, om, fixed_b, device_budget, host_budget, virtual: int = 1) -> int:
    if fixed_b is not None:
        return fixed_b if _fits(cm, m, fixed_b, pm, om, device_budget, host_budget, virtual) else 0
    if not _fits(cm, m, 1, pm, om, device_budget, host_budget, virtual):
        return 0
    lo, hi = 1, 2
    while _fits(cm, m, hi, pm, om, device_budget, host_budget, virtual) and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(cm, m, mid, pm, om, device_budget, host_budget, virtual) else (lo, mid)
    return lo


def _unverified(cm: CostModel, fixed_b: int | None, usable: tuple[float, float], b: int, d: float, h: float,
                est: Estimate) -> None:  # fmt: skip
    """NothingFits where the budgets are not what failed: the cost model's choices kept
    exceeding them once traced, and with the budgets less each miss none was left."""
    error = NothingFits(
        f"nothing fits as verified: the cost model's choice at local batch {b} priced {_size(d)} device and "
        f"{_size(h)} host per device, but its traced step needs {_size(est.device_bytes)} and "
        f"{_size(est.host_bytes)} against {_size(usable[0])} and {_size(usable[1])} usable; searching again "
        f"within the budgets less each such miss left no candidate (the cost model underestimates this step: "
        f"give --batch-size, or a larger budget)"
    )
    error.candidates = _candidates(cm, fixed_b, *usable)
    error.device_peak = d
    raise error


class NothingFits(ConfigError):
    """No map, batch and placement of parameters and optimizer state fits the budgets;
    ``candidates``: the table, each row at the smallest batch."""

    candidates: tuple[Candidate, ...] = ()
    device_peak: float = 0.0  # the smallest device peak found (bytes per device)


def _nothing_fits(
    cm: CostModel,
    e1: Estimate,
    fixed_b: int | None,
    device_budget: float,
    host_budget: float,
    usable: tuple[float, float],
) -> None:
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
    error.candidates = _candidates(cm, fixed_b, *usable)
    error.device_peak = d
    raise error
