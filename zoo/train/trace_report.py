"""A run's profile analysed (its files read by :mod:`zoo.train.trace_files`): per step, the
wall time, the device's compute and collectives, host<->device copies each way (count, bytes,
achieved GB/s), and how much copy time compute hid versus how much was exposed; then the ops, the
program's regions (decoder layers forward and backward, the rest, the update) and the named
tensors (:mod:`zoo.layers.named`: forward, recomputed, backward) by time.

A step is the window of its ``train_step`` trace annotation (the loop waits for each profiled
step inside it, so the device's work falls in the window). Device work is read from the device
planes of the trace: on GPU the CUDA stream lines (kernels; ``Memcpy*`` records are the copies),
elsewhere the ``XLA Ops`` line. XLA:CPU has no device plane: its ops run on host threads and are
read there, and with one memory there are no copies to report. Op names are mapped to their
source (``op_name`` metadata, with the ``jax.named_scope`` of each decoder layer and of each named
tensor) through the compiled step's HLO text, saved beside the trace.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from zoo.train.op_names import (  # noqa: F401  (re-exported: the report's API before the split)
    NO_SOURCE,
    OUTSIDE,
    UNNAMED,
    hlo_sources,
    named_region,
    phase,
    region,
    short_source,
    tensor_names,
)
from zoo.train.trace_files import Event, ProfileError, find_traces, read_events, read_step_info  # noqa: F401

STEP_EVENT = "train_step"  # the loop's jax.profiler.StepTraceAnnotation
_COLLECTIVE = re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|allreduce|allgather")
_DERIVED = ("XLA Modules", "Steps", "Framework", "TensorFlow", "Source", "Launch Stats", "Host Offload")
PHASES = ("forward", "recompute", "backward", "other")


def kind(e: Event) -> str:
    """``h2d`` / ``d2h`` / ``d2d`` for a copy, ``collective`` or ``compute``."""
    name = e.name.lower()
    details = str(e.stats.get("memcpy_details", "")).lower()
    if "memcpy" in name or details:
        for k in ("h2d", "d2h", "d2d"):
            if k in name:
                return k
        src, dst = re.search(r"kind_src:(\w+)", details), re.search(r"kind_dst:(\w+)", details)
        host = ("host", "pinned", "pageable")
        if src and dst:
            return ("h" if src.group(1) in host else "d") + "2" + ("h" if dst.group(1) in host else "d")
        return "d2d"
    return "collective" if _COLLECTIVE.search(f"{name} {e.op.lower()}") else "compute"


def copy_bytes(e: Event) -> int:
    """A copy's bytes: its ``memcpy_details`` size, else a bytes stat (0 when the trace has neither)."""
    m = re.search(r"size:(\d+)", str(e.stats.get("memcpy_details", "")))
    if m:
        return int(m.group(1))
    for key in ("num_bytes", "bytes", "bytes_transferred", "memcpy_bytes"):
        if key in e.stats:
            return int(e.stats[key])
    return 0


def device_events(events: list[Event]) -> tuple[list[Event], str]:
    """The events of the device's work and where they came from: GPU stream lines, a device's
    ``XLA Ops`` line, or (XLA:CPU) the XLA ops on host threads."""
    devices = sorted({e.plane for e in events if e.plane.startswith("/device:")})
    if devices:
        plane = devices[0]  # the first local device; the others run the same program
        lines = {e.line for e in events if e.plane == plane}
        streams = {n for n in lines if n.startswith("Stream")}
        use = streams or ({"XLA Ops"} & lines) or {n for n in lines if not n.startswith(_DERIVED)}
        return [e for e in events if e.plane == plane and e.line in use], plane.removeprefix("/device:")
    ops = [e for e in events if e.plane.startswith("/host:") and "hlo_op" in e.stats and not e.name.startswith("end: ")]
    return ops, "cpu"


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum((b - a for a, b in spans), 0.0)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of intervals."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class Copies:
    """Copies one way during a step: how many, bytes, busy seconds."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    def rate(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 and self.nbytes else None


@dataclass
class StepFigures:
    """One profiled step (seconds)."""

    step: int
    wall: float
    compute: float
    collectives: float
    h2d: Copies = field(default_factory=Copies)
    d2h: Copies = field(default_factory=Copies)
    hidden: float = 0.0  # copy time under compute or collectives
    exposed: float = 0.0  # copy time with nothing else running


@dataclass
class Report:
    """What :func:`analyse` found: the steps, the device read, op and region times over all steps."""

    device: str
    steps: list[StepFigures]
    ops: list[tuple[str, str, float, int]]  # (op, source, seconds, count), longest first
    regions: dict[str, float]
    named: dict[str, dict[str, float]] = field(default_factory=dict)  # named region -> phase -> seconds
    threads: int = 1  # the trace lines (host threads, GPU streams) the device's work was read from


def analyse(events: list[Event], sources: dict[str, str] | None = None, names: frozenset[str] | None = None) -> Report:
    """The per-step figures of a trace's events; ``sources``: :func:`hlo_sources` of the step;
    ``names``: the named tensors' scopes (default :func:`tensor_names`)."""
    sources = sources or {}
    names = tensor_names() if names is None else names
    work, device = device_events(events)
    windows = sorted((int(e.stats.get("step_num", 0)), e.start, e.end) for e in events if e.name == STEP_EVENT)
    steps: list[StepFigures] = []
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    regions: dict[str, float] = defaultdict(float)
    named: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))
    for number, a, b in windows:
        inside = [e for e in work if a <= e.start < b]
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        fig = StepFigures(number, (b - a) / 1e9, 0.0, 0.0)
        for e in inside:
            k = kind(e)
            spans["copy" if k in ("h2d", "d2h") else k].append((e.start, min(e.end, b)))
            if k in ("h2d", "d2h"):
                c = getattr(fig, k)
                c.count, c.nbytes, c.seconds = c.count + 1, c.nbytes + copy_bytes(e), c.seconds + (e.end - e.start) / 1e9
        busy = _union(spans["compute"] + spans["collective"])
        copies = _union(spans["copy"])
        fig.compute, fig.collectives = _length(_union(spans["compute"])) / 1e9, _length(_union(spans["collective"])) / 1e9
        fig.hidden = _overlap(copies, busy) / 1e9
        fig.exposed = _length(copies) / 1e9 - fig.hidden
        steps.append(fig)
        for e, self_time in _self_times(inside):
            ops[e.op][0] += self_time / 1e9
            ops[e.op][1] += 1
            source = sources.get(e.op, "")
            regions[region(source)] += self_time / 1e9
            named[named_region(source, names)][phase(source)] += self_time / 1e9
    ranked = sorted(((op, sources.get(op, ""), t, int(n)) for op, (t, n) in ops.items()), key=lambda r: -r[2])
    last = {UNNAMED: 1, OUTSIDE: 2, NO_SOURCE: 3}  # after the named tensors, longest first
    order = sorted(named, key=lambda r: (last.get(r, 0), -sum(named[r].values())))
    return Report(device, steps, ranked, dict(sorted(regions.items(), key=lambda r: -r[1])),
                  {r: named[r] for r in order}, len({(e.plane, e.line) for e in work}) or 1)  # fmt: skip


def _self_times(events: list[Event]) -> list[tuple[Event, float]]:
    """Each event's time less that of the events nested in it on the same line (XLA:CPU's while
    loops hold their bodies' ops)."""
    out: list[tuple[Event, float]] = []
    by_line: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for e in events:
        by_line[e.plane, e.line].append(e)
    for line in by_line.values():
        stack: list[list[Any]] = []  # [event, time of its children]
        for e in sorted(line, key=lambda e: (e.start, -e.end)):
            while stack and stack[-1][0].end <= e.start:
                done = stack.pop()
                out.append((done[0], done[0].end - done[0].start - done[1]))
            if stack:
                stack[-1][1] += min(e.end, stack[-1][0].end) - e.start
            stack.append([e, 0.0])
        out += [(ev, ev.end - ev.start - child) for ev, child in stack]
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:9.2f}"


def _copies(c: Copies) -> str:
    rate = c.rate()
    return f"{c.count:5d} {c.nbytes / 2**20:9.1f} {f'{rate:7.1f}' if rate is not None else '      -'}"


def format_report(report: Report, *, top: int = 15) -> str:
    """The report as text: the per-step table, the regions, the named tensors and the top ops."""
    cpu = report.device == "cpu"
    lines = [f"device: {report.device}; {len(report.steps)} profiled step(s)"]
    if cpu:
        lines.append("XLA:CPU: one memory for host and device, so no host<->device copies to report (offloaded "
                     "tensors stay in RAM); compute is the XLA ops' busy time on the host threads")  # fmt: skip
    lines += ["", "  step    wall ms  compute ms  collect ms | H2D n       MB    GB/s | D2H n       MB    GB/s |"
              "  hidden ms exposed ms  exposed %"]  # fmt: skip
    for s in report.steps:
        share = f"{100 * s.exposed / s.wall:9.1f}%" if s.wall > 0 else "        -"
        lines.append(f"{s.step:6d} {_ms(s.wall)}   {_ms(s.compute)}   {_ms(s.collectives)} | {_copies(s.h2d)} | "
                     f"{_copies(s.d2h)} | {_ms(s.hidden)}  {_ms(s.exposed)} {share}")  # fmt: skip
    total = sum(report.regions.values()) or 1.0
    if report.threads > 1:  # the steps' compute counts busy time once; the totals add up every line's
        where = "host threads (XLA:CPU runs each device's ops on its own)" if cpu else "trace lines (streams)"
        compute = sum(s.compute for s in report.steps)
        note = (f"the totals below add up the ops' time on all {report.threads} {where}: {_ms(total).strip()} ms, "
                f"against the steps' {_ms(compute).strip()} ms of compute (the time any of them was busy, counted "
                "once)")  # fmt: skip
        lines += ["", note]
    lines += ["", "time by region (self time of the ops, all profiled steps):"]
    lines += [f"  {name:32s} {_ms(t)} ms  {100 * t / total:5.1f}%" for name, t in report.regions.items()]
    lines += ["", "time by named tensor (self time of the ops under its scope, the innermost; all profiled steps):",
              f"  {'named tensor':26s} " + " ".join(f"{p + ' ms':>12s}" for p in (*PHASES, "total")) + "  share"]  # fmt: skip
    for name, by_phase in report.named.items():
        t = sum(by_phase.values())
        lines.append(f"  {name:26s} " + " ".join(f"   {_ms(by_phase[p])}" for p in PHASES) +
                     f"    {_ms(t)} {100 * t / total:5.1f}%")  # fmt: skip
    lines += ["", f"top {top} ops by self time:", f"  {'op':36s} {'ms':>9s} {'count':>6s}  source"]
    for op, source, t, n in report.ops[:top]:
        lines.append(f"  {op[:36]:36s} {_ms(t)} {n:6d}  {short_source(source)}")
    return "\n".join(lines)
