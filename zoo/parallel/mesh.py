"""Building the device mesh and joining a multi-host job: what runs before any step."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from zoo.core.mesh import AXES, check_axis, parse_mesh
from zoo.errors import MeshError


def make_mesh(spec: str | Mapping[str, int], *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with the six axes of :data:`AXES`, in that order, over ``devices`` (default all).

    The axis sizes must multiply to the device count: a silently idle device is a bug.
    Axis types are ``Auto`` so jitted code outside the step may still reshard freely.
    """
    if isinstance(spec, str):
        sizes = parse_mesh(spec)
    else:
        sizes = dict.fromkeys(AXES, 1)
        for name, size in spec.items():
            check_axis(name, "make_mesh")
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
                raise MeshError(f"make_mesh: size of axis {name!r} must be a positive integer, got {size!r}")
            sizes[name] = int(size)
    devices = list(jax.devices() if devices is None else devices)
    total = math.prod(sizes.values())
    if total != len(devices):
        layout = " x ".join(f"{a}={sizes[a]}" for a in AXES)
        raise MeshError(
            f"mesh {layout} has {total} devices but {len(devices)} are available; the sizes must multiply to {len(devices)}"
        )
    shape = tuple(sizes[a] for a in AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    try:
        return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)
    except (ValueError, NotImplementedError):  # a device set make_mesh cannot tile: row-major order
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=auto)


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """``jax.distributed.initialize`` from arguments or the environment; returns whether it ran.

    Falls back to ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``,
    then SLURM (``SLURM_NTASKS`` > 1: JAX's own cluster detection). One process: a no-op, so
    the same recipe runs on a laptop and on a cluster.
    """
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    slurm = int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env
    if coordinator is None and not slurm:
        if num_processes not in (None, 1):
            raise MeshError(f"initialize_distributed: num_processes={num_processes} needs a coordinator address")
        return False
    if num_processes == 1:
        return False
    if coordinator is not None and (num_processes is None or process_id is None):
        raise MeshError(
            f"initialize_distributed: coordinator {coordinator!r} given but "
            f"{'num_processes' if num_processes is None else 'process_id'} is missing "
            "(flag or JAX_NUM_PROCESSES / JAX_PROCESS_ID)"
        )
    if coordinator is None:
        jax.distributed.initialize()  # SLURM: JAX reads the job's own variables
    else:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    return True

