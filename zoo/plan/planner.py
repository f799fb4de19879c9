"""The planner: :func:`plan`, the placement map (and batch, and mesh) that trains fastest within
a device and a host memory budget.

On a given mesh it is :func:`zoo.plan.mesh_plan.plan_mesh`'s plan (every candidate priced by the
cost model, :mod:`zoo.plan.costs`; the fastest that fits verified by a full estimate of its own
step, then by the CUDA export, :mod:`zoo.plan.offloads`); given a device count, the mesh search's
(:mod:`zoo.plan.search`), which plans the most promising meshes so. The plan and its table are
:mod:`zoo.plan.plans`'s. The modules below are layered: this one over the search, the search over
the one-mesh planner, that over the cost model.
"""

from __future__ import annotations

import math
from typing import Any

from zoo.errors import ConfigError
from zoo.hardware import Hardware
from zoo.plan import search
from zoo.plan._step import mesh_sizes as _mesh_sizes
from zoo.plan._step import mesh_spec
from zoo.plan.costs import MICROBATCH_ROWS, CostModel
from zoo.plan.mesh_plan import (
    TREE_PLACES,
    VIRTUAL_TOLERANCE,
    NothingFits,
    check_inputs,
    cost_model,
    plan_mesh,
    price,
)
from zoo.plan.offloads import verify_offloads
from zoo.plan.plans import Candidate, Plan, candidate_table
from zoo.train.hlo import host_moves, tensor_type

# The HLO-text parsers' names before they moved to zoo.train.hlo.
_host_moves, _tensor_type = host_moves, tensor_type

# The names other modules import from here, where they were defined before the splits.
__all__ = [
    "MICROBATCH_ROWS", "TREE_PLACES", "VIRTUAL_TOLERANCE", "Candidate", "CostModel", "NothingFits", "Plan",
    "_host_moves", "_tensor_type", "candidate_table", "cost_model", "plan", "plan_mesh", "price", "verify_offloads",
]  # fmt: skip


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
    virtual_stages: int | None = None,
    schedule: str | None = None,
    precision: Any = None,
) -> Plan:
    """The placement map, parameter and optimizer-state memory, and (``batch_size=None``) the
    largest global batch that maximise estimated tokens per second within ``device_budget``
    and ``host_budget`` bytes per device (default: the hardware's HBM and host memory).

    ``devices`` without ``mesh``: the mesh too, searched over zoo's axes
    (:func:`zoo.plan.search.search`: every mesh of ``devices`` that divides the model, pruned by
    memory, the ``top`` most promising planned in full; ``pipeline=False``: no pipeline axis);
    the plan's ``meshes`` hold the table.
    ``virtual_stages``: on a mesh with a pipeline axis, the interleaved schedule's chunks per
    stage; ``None`` (default) searches them (1, GPipe, and every divisor of the layers per stage
    where the micro-batches are a multiple of the stages), taking the fewest within
    :data:`~zoo.plan.mesh_plan.VIRTUAL_TOLERANCE` of the fastest; ``1`` plans GPipe only. The plan says its choice.
    ``schedule``: on a mesh with a pipeline axis, ``"gpipe"`` or ``"1f1b"`` (each micro-batch's
    backward pass as soon as it leaves the last stage: fewer micro-batches' saved tensors kept);
    ``None`` (default) prices both and takes the faster that fits, GPipe where they tie.
    ``precision``: the family's precision map or its spec (``"fp8_all"``): its tensorwise FP8
    matmuls are priced at the hardware's FP8 peak, and the memory estimate is the FP8 step's (a
    kept FP8 GEMM input is its FP8 copy and scales).
    ``hardware``: a name of :data:`zoo.hardware.HARDWARE` (default ``"cpu"``, one memory:
    nothing is offloaded). ``margin``: the fraction of each budget kept free for the
    estimate's own error (10% is the worst measured against XLA:CPU on the test grid). Raises :class:`~zoo.errors.MeshError` for a mesh that does not divide
    the model or the batch, :class:`~zoo.errors.ConfigError` for an unknown hardware name or a
    budget nothing fits (naming the smallest peak found and what dominates it).
    """
    check_inputs(device_budget=device_budget, host_budget=host_budget, batch_size=batch_size)
    if devices is not None:
        if not isinstance(devices, int) or devices < 1:
            raise ConfigError(f"plan: devices must be a positive integer, got {devices!r}")
        if mesh is None:
            return search.search(model_or_config, devices=devices, seq_len=seq_len, device_budget=device_budget,
                                 batch_size=batch_size, host_budget=host_budget, hardware=hardware,
                                 compute_dtype=compute_dtype, verify=verify, margin=margin, top=top,
                                 pipeline=pipeline, virtual_stages=virtual_stages, schedule=schedule,
                                 precision=precision)  # fmt: skip
        n = math.prod(_mesh_sizes(mesh).values())
        if n != devices:
            raise ConfigError(f"plan: mesh {mesh_spec(_mesh_sizes(mesh))} has {n} devices, not devices={devices}")
    return plan_mesh(model_or_config, seq_len=seq_len, device_budget=device_budget, batch_size=batch_size,
                     host_budget=host_budget, mesh=mesh, hardware=hardware, compute_dtype=compute_dtype,
                     verify=verify, margin=margin, virtual_stages=virtual_stages, schedule=schedule,
                     precision=precision)  # fmt: skip
