"""A training run's memory planned as it starts (``recipes/train.py --placement auto``), and
XLA's pinned host pool sized for what the run puts in host memory.

Training (:mod:`zoo.train`) sits below the planner and never imports it: a recipe asks here for
the placement, parameter and optimizer memory, then hands them to :func:`zoo.train.train`.
Errors are ``ConfigError`` (``MeshError`` for a mesh the model does not fit); the recipe names
its flag (``--placement auto: ...``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from zoo import parallel, runtime
from zoo.core.registry import family_of
from zoo.errors import ConfigError
from zoo.hardware import HARDWARE, for_device, measure_host_link
from zoo.hardware import hardware as lookup
from zoo.plan.estimate import estimate
from zoo.plan.planner import plan
from zoo.plan.plans import Plan
from zoo.train.setup import run_config


def hardware_name(device: Any) -> str:
    """The hardware of zoo.plan's table for a JAX device: its platform on CPU, else the first
    table name within its device kind (``"NVIDIA H200"`` -> ``h200``); a ``ConfigError`` for a
    kind the table lacks."""
    name = for_device(device)
    if name is None:
        raise ConfigError(f"device kind {device.device_kind!r} is not in zoo.plan's hardware table "
                          f"({', '.join(HARDWARE)}); name one with --hardware")  # fmt: skip
    return name


def plan_placement(
    model: Any, mesh: Any, *, seq_len: int, batch_size: int, virtual_stages: int = 1, hardware: str | None = None,
    device_budget_gib: int | float | None = None,  # noqa: PYI041  (beartype takes no int for float)
) -> Plan:
    """zoo.plan's fastest placement map, parameter and optimizer memory for ``model`` on ``mesh``
    (``None``: one device) at this batch and sequence, within the device budget
    (``device_budget_gib``, else the first device's own allocator limit, else the hardware's
    HBM), for the schedule the run will use (``virtual_stages``, not one the planner would
    choose). ``hardware``: a name of zoo.plan's table (default: the first device's). On a
    GPU the host link is measured and the table's figure lowered to it where slower. The plan
    is printed; off CPU its host memory is checked against the machine (:func:`check_plan_host_memory`)."""
    device = jax.devices()[0]
    hw: Any = hardware or hardware_name(device)
    budget = device_budget_gib * 2**30 if device_budget_gib else None
    if budget is None:
        stats = device.memory_stats() or {}
        budget = stats.get("bytes_limit")  # the device's own allocator limit, where it has one
    if device.platform == "gpu":  # the link this machine really has, where slower than the table's
        entry = lookup(hw)
        measured = min(measure_host_link(device))
        print(f"host link measured: {measured / 1e9:.1f} GB/s per direction (table: {entry.host_link / 1e9:.0f})",
              flush=True)  # fmt: skip
        if measured < entry.host_link:
            hw = dataclasses.replace(entry, host_link=measured)
    result = plan(model, seq_len=seq_len, batch_size=batch_size, mesh=mesh, hardware=hw, device_budget=budget,
                  compute_dtype=model.compute_dtype, verify=False, virtual_stages=virtual_stages)  # fmt: skip
    print(result, flush=True)
    if device.platform != "cpu":
        check_plan_host_memory(result, 1 if mesh is None else len(mesh.local_devices))
    return result


def check_plan_host_memory(result: Any, devices: int) -> None:
    """A :class:`~zoo.plan.Plan`'s host memory (its estimate's ``host_bytes`` per device) for
    this process's ``devices`` within XLA's pool and the machine (:func:`zoo.runtime.size_host_pool`'s
    ``ConfigError`` otherwise)."""
    need = result.estimate.host_bytes * devices
    if need > 0:
        runtime.size_host_pool(need, what="the plan")


def size_host_pool_from_flags(flags: Any) -> None:
    """:func:`size_host_pool` for ``recipes/train.py``'s flags, before the backend starts:
    nothing on XLA:CPU (one memory, no pinned pool); for ``--placement auto``, planned after the
    backend starts, the pool capped at the machine's memory (:func:`open_host_pool`)."""
    if flags.cpu_devices or os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return
    if flags.placement == "auto":
        return open_host_pool()
    size_host_pool(run_config(flags.checkpoint, flags.model, flags.preset, flags.attention), placement=flags.placement,
                   mesh=flags.mesh, processes=flags.num_processes or 1, param_memory=flags.param_memory,
                   opt_memory=flags.opt_memory, batch_size=flags.batch_size, seq_len=flags.seq_len,
                   compute_dtype=jnp.dtype(flags.compute_dtype))  # fmt: skip


def open_host_pool() -> None:
    """Before the backend starts, for a placement planned after it: XLA's pinned host pool
    capped at the machine's memory (it grows on demand; at least XLA's default), unless the
    user set the cap; :func:`check_plan_host_memory` checks the plan against it."""
    total = runtime.physical_memory()
    if total is not None and runtime.HOST_POOL_ENV not in os.environ:
        os.environ[runtime.HOST_POOL_ENV] = str(max(runtime.HOST_POOL_DEFAULT_GIB, total // 2**30))


def size_host_pool(config: Any, *, placement: str | None, mesh: str, processes: int, param_memory: str,
                   opt_memory: str, batch_size: int, seq_len: int, compute_dtype: Any) -> None:  # fmt: skip
    """Size XLA's pinned host pool (GPU; :data:`zoo.runtime.HOST_POOL_ENV`, 64 GiB by default)
    for what a run of ``config`` puts in host memory, before the backend starts: the step's
    estimate (:func:`zoo.plan.estimate`) for this process's devices (``mesh``'s over
    ``processes``), said in a line. Nothing in pinned host memory: nothing to size. A
    ``ConfigError`` when the machine has too little; a ``PlacementError`` or ``MeshError`` for
    a map or mesh spec that does not parse."""
    where = family_of(config).placement_map.parse(placement) if placement else None
    sizes = parallel.parse_mesh(mesh) if mesh else {}
    if "pinned_host" not in (param_memory, opt_memory) and not (where and where.placed("pinned_host")):
        return
    devices = math.prod(sizes.values()) // processes if sizes else 1
    step = estimate(config, batch_size=batch_size, seq_len=seq_len, placement=where, mesh=mesh or None,
                    param_memory=param_memory, opt_memory=opt_memory, compute_dtype=compute_dtype)  # fmt: skip
    need = step.host_bytes * max(devices, 1)
    gib = runtime.size_host_pool(need, what="the run's placements")
    print(f"pinned host memory: {need / 2**30:.1f} GiB estimated for this process; XLA's pool capped at {gib} GiB",
          flush=True)  # fmt: skip
