"""The buffers of a program on a timeline: when each is live, the most bytes live at once, and the
heap they pack into (``zoo.plan._liveness`` builds the program from a jaxpr and asks these)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class Buffer:
    size: int
    host: bool
    what: str  # producing primitive, or the checkpoint name that views it
    pinned: bool = False  # an argument or an output of the program: not a temporary
    early: bool = False  # allocated at the start of its program (a loop's zero-initialised state)
    start: int = -1
    end: int = -1
    first: float = math.inf  # first read
    readers: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class Op:
    reads: list[Buffer]
    writes: list[Buffer]
    body: Program | None = None  # a loop's body, run inside the op's time span
    state: list[Buffer] = field(default_factory=list)  # a while loop's copies of what it carries
    time: int = -1
    finish: int = -1


@dataclass(eq=False)
class Program:
    ops: list[Op]
    outputs: list[Buffer]
    length: int = 1  # a scan body's trip count


@dataclass(frozen=True)
class Peak:
    """Temporaries of a program: the most bytes live at once on device (``live``) and on host,
    the device heap those buffers pack into (``device``), and what was live at the device's
    live peak (bytes by producing primitive or checkpoint name)."""

    device: int
    live: int
    host: int
    at_peak: dict[str, int]
    # Live device bytes until the last loop of the program ends (forward and backward passes),
    # and after it (the optimizer's update).
    passes: int = 0
    update: int = 0


# -- timeline, live peak, heap -----------------------------------------------------------------


def _schedule(prog: Program, t: int, seen: list[Buffer]) -> int:
    """Give every buffer of ``prog`` (bodies included) a [start, end] in op time from ``t``."""
    begin = t
    for op in prog.ops:
        op.time = t0 = t
        for b in (*op.writes, *op.state):
            if b.start < 0:
                b.start = begin if b.early else t0
                seen.append(b)
        for b in op.reads:
            b.first = min(b.first, t0)
            b.readers.append(op)
        if op.body is not None:
            t = _schedule(op.body, t + 1, seen)
        for b in (*op.reads, *op.writes, *op.state):
            b.end = max(b.end, t)
        op.finish = t
        t += 1
    for b in prog.outputs:
        b.end = max(b.end, t)
    return t


def _sink(prog: Program) -> None:
    """Run each op as late as its first reader allows, latest ops first, where what that keeps
    alive longer is no larger than what it no longer holds: XLA's scheduler does, so a layer's
    gathered weights, say, are not all live from the top of the layer."""
    for op in reversed(prog.ops):
        if op.body is not None:
            _sink(op.body)
            continue
        if not op.writes:
            continue
        when = min(b.first for b in op.writes)
        if when == math.inf or when <= op.time:
            continue
        extended = {id(r): r for r in op.reads if r.end < when and not r.pinned}
        if sum(r.size for r in extended.values()) > sum(b.size for b in op.writes):
            continue
        op.time = int(when)
        for b in op.writes:
            b.start = op.time
        for r in op.reads:
            r.end = max(r.end, op.time)
            r.first = min(o.time for o in r.readers)


def intervals(prog: Program) -> list[Buffer]:
    for buf in _all_buffers(prog):
        buf.start = buf.end = -1
        buf.first = math.inf
        buf.readers = []
    seen: list[Buffer] = []
    _schedule(prog, 0, seen)
    _sink(prog)
    return [b for b in seen if not b.pinned and b.size > 0]


def _all_buffers(prog: Program) -> list[Buffer]:
    out: list[Buffer] = []
    for op in prog.ops:
        out.extend((*op.reads, *op.writes, *op.state))
        if op.body is not None:
            out.extend(_all_buffers(op.body))
    out.extend(prog.outputs)
    return out


def live_peak(bufs: list[Buffer], host: bool = False) -> tuple[int, int]:
    """Most bytes live at once, and when."""
    events: dict[int, int] = {}
    for b in bufs:
        if b.host == host:
            events[b.start] = events.get(b.start, 0) + b.size
            events[b.end + 1] = events.get(b.end + 1, 0) - b.size
    live = best = 0
    when = 0
    for t in sorted(events):
        live += events[t]
        if live > best:
            best, when = live, t
    return best, when


def _heap(bufs: list[Buffer], floor: int) -> int:
    """Size of the arena the device buffers pack into: largest first, each at the lowest
    offset free for its whole lifetime (best fit among the gaps). Buffers under ``floor``
    bytes are not packed; their live peak is added on top."""
    big = sorted((b for b in bufs if not b.host and b.size >= floor), key=lambda b: (-b.size, b.start))
    small = [b for b in bufs if not b.host and b.size < floor]
    starts = np.zeros(len(big), np.int64)
    ends = np.zeros(len(big), np.int64)
    offs = np.zeros(len(big), np.int64)
    sizes = np.zeros(len(big), np.int64)
    top = 0
    for i, b in enumerate(big):
        mask = (starts[:i] <= b.end) & (ends[:i] >= b.start)
        o, s = offs[:i][mask], sizes[:i][mask]
        order = np.argsort(o)
        o, s = o[order], s[order]
        best = None
        cursor = 0
        for lo, size in zip(o.tolist(), s.tolist()):
            gap = lo - cursor
            if gap >= b.size and (best is None or gap < best[1]):
                best = (cursor, gap)
            cursor = max(cursor, lo + size)
        off = best[0] if best is not None else cursor
        starts[i], ends[i], offs[i], sizes[i] = b.start, b.end, off, b.size
        top = max(top, off + b.size)
    return top + live_peak(small)[0]


def peak(prog: Program) -> Peak:
    bufs = intervals(prog)
    live, when = live_peak(bufs)
    host, _ = live_peak(bufs, host=True)
    at_peak: dict[str, int] = {}
    for b in bufs:
        if not b.host and b.start <= when <= b.end:
            at_peak[b.what] = at_peak.get(b.what, 0) + b.size
    device = _heap(bufs, floor=max(1, live // 2000))
    loops = [op for op in prog.ops if op.body is not None]
    split = max((op.finish for op in loops), default=-1)
    passes = live_peak([b for b in bufs if b.start <= split])[0] if loops else live
    update = live_peak([_clip(b, split + 1) for b in bufs if b.end > split])[0] if loops else 0
    return Peak(device=max(device, live), live=live, host=host, at_peak=at_peak, passes=passes, update=update)


def _clip(b: Buffer, start: int) -> Buffer:
    return Buffer(b.size, b.host, b.what, start=max(b.start, start), end=b.end)
