"""What the planner returns: a :class:`Plan` (the chosen map, batch and mesh with its verified
estimate) and the :class:`Candidate` rows of the table it was chosen over."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from zoo.hardware import HARDWARE, Hardware
from zoo.placement import PlacementMap
from zoo.plan._step import mesh_sizes as _mesh_sizes
from zoo.plan.estimate import Estimate, GiB
from zoo.plan.meshes import mesh_table


@dataclass(frozen=True)
class Candidate:
    """One row of the plan's table: a map, where parameters and optimizer state live, the
    largest batch it fits (``None``: none does) and the model's figures at that batch (with a
    pipeline axis, on the schedule of ``virtual_stages``: 1 is GPipe's)."""

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
    virtual_stages: int = 1


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
    meshes_planned: int = 0  # of the meshes, how many the search planned in full
    # Of those not planned, how many the quick model, off by as much as it was on the meshes
    # planned, could still price faster than the chosen one (0: none can be faster).
    meshes_unruled: int = 0
    search_top: int = 0  # the search's --top
    # With a pipeline axis: the micro-batches per device (TrainConfig.microbatches), the bubble's
    # share of the ticks, and per device per step the point-to-point bytes and those all-reduced
    # over the pipeline axis (CostModel.pipeline_bytes); None / 0 without one. virtual_stages:
    # the interleaved schedule's chunks per stage (TrainConfig.virtual_stages; 1: GPipe).
    microbatches: int | None = None
    bubble: float = 0.0
    p2p_bytes: float = 0.0
    pipeline_reduce_bytes: float = 0.0
    virtual_stages: int = 1
    schedule: str = "gpipe"  # TrainConfig.schedule: "gpipe" or "1f1b"

    @property
    def devices(self) -> int:
        return math.prod(_mesh_sizes(self.mesh or None).values())

    def table(self) -> str:
        """The candidates as an aligned text table (GiB per device; MiB for small models)."""
        return candidate_table(self.candidates)

    def __str__(self) -> str:
        table = HARDWARE.get(self.hardware.name)
        job = f" ({self.hardware.domain} of the job's devices a fast domain)" if table and table.domain != self.hardware.domain else ""
        head = (
            f"plan: {self.estimate.model} on {self.hardware.name}{job} x {self.estimate.mesh or 'one device'}, "
            f"{self.seq_len} tokens per sequence; budgets {_size(self.device_budget)} device, "
            f"{_size(self.host_budget)} host per device"
        )
        lines = [head]
        if self.meshes:
            lines += [f"meshes of {self.devices} devices, the chosen first:", mesh_table(self.meshes),
                      f"planned {self.meshes_planned} of {len(self.meshes)} meshes in full; " + (
                          f"{self.meshes_unruled} more could be faster, by the quick model off by as much as it was "
                          f"on those planned: --top {self.search_top + self.meshes_unruled} plans them"
                          if self.meshes_unruled else "no other could be faster, by the quick model off by as much "
                          "as it was on those planned"), "",
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
                f"  pipeline: microbatches={self.microbatches} (TrainConfig.microbatches), virtual_stages="
                f"{self.virtual_stages} (TrainConfig.virtual_stages), schedule={self.schedule} (TrainConfig.schedule), "
                f"bubble {self.bubble:.1%} of "
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
