"""What a batch holds and where it goes: a batch as a dict of ``[A, B, S]`` arrays, the
(seed, step)-determined batches of a run, and their rows placed on a mesh, each process
putting only its own rows on its own devices."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from zoo import parallel
from zoo.errors import ConfigError
from zoo.train.config import TrainConfig

# What a batch may hold besides the token ids: packed rows' segments and positions, and which
# targets count (zoo.data.pack_documents). Each is [B, S] like the ids (or [A, B, S] per step).
BATCH_FIELDS = ("positions", "segment_ids", "loss_mask")


def as_batch(batch: Any) -> dict[str, Any]:
    """A batch as a dict: ``{"input_ids": ...}`` plus any of :data:`BATCH_FIELDS`; a bare
    token array is its ``input_ids``. Unknown keys are an error naming them."""
    if not isinstance(batch, Mapping):
        return {"input_ids": batch}
    unknown = set(batch) - {"input_ids", *BATCH_FIELDS}
    if "input_ids" not in batch or unknown:
        raise ConfigError(
            f"a batch is input_ids plus any of {list(BATCH_FIELDS)}; got keys {sorted(batch)}"
            + (f" (unknown: {sorted(unknown)})" if unknown else "")
        )
    return dict(batch)


def _batch_sharding(mesh: Any, micro: bool) -> jax.sharding.NamedSharding:
    axes = tuple(a for a in parallel.BATCH_AXES if mesh.shape[a] > 1)
    return NamedSharding(mesh, PartitionSpec(*([None] if micro else []), axes or None))


def check_batch_layout(cfg: Any, mesh: Any) -> None:
    """Refuse (``ConfigError``, naming the setting and the flag) a batch that ``mesh`` cannot
    split: rows over the batch axes, each sequence into equal chunks over ``context``, each
    device's rows into a pipeline's micro-batches (``cfg.microbatches``, with
    ``cfg.virtual_stages`` a multiple of the stages)."""
    if mesh is None:
        return
    stages = mesh.shape.get(parallel.PIPELINE, 1)
    microbatches, virtual = getattr(cfg, "microbatches", None), getattr(cfg, "virtual_stages", 1)
    axes = [a for a in parallel.BATCH_AXES if mesh.shape[a] > 1]
    n = math.prod(mesh.shape[a] for a in axes)
    split = " x ".join(f"{a}={mesh.shape[a]}" for a in axes) or "(none)"
    if cfg.batch_size % n:
        raise ConfigError(f"batch_size (--batch-size) {cfg.batch_size} is not divisible by the mesh's batch axes "
                          f"{split} = {n}: each of their devices takes an equal share of the rows")  # fmt: skip
    context = mesh.shape.get("context", 1)
    if context > 1 and cfg.seq_len % (2 * context):
        raise ConfigError(f"seq_len (--seq-len) {cfg.seq_len} is not divisible by {2 * context}: the mesh's "
                          f"context={context} cuts each sequence into {2 * context} equal chunks")  # fmt: skip
    if stages > 1:
        m = stages if microbatches is None else microbatches
        given = microbatches is not None
        what = f"microbatches (--microbatches) {m}" if given else f"the default microbatches (one per stage) {m}"
        rows = cfg.batch_size // n
        if rows % m:
            works = [d for d in range(1, rows + 1) if rows % d == 0 and (virtual == 1 or d % stages == 0)]
            raise ConfigError(f"{what} must divide each device's {rows} rows (batch_size (--batch-size) "
                              f"{cfg.batch_size} over the mesh's batch axes {split} = {n}); "
                              f"possible: {works or 'none: raise --batch-size'}")  # fmt: skip
        if virtual > 1 and m % stages:
            raise ConfigError(f"virtual_stages (--virtual-stages) {virtual}: the interleaved schedule needs "
                              f"{what} a multiple of the {stages} pipeline stages")  # fmt: skip


def local_rows(mesh: Any, batch_size: int) -> np.ndarray | None:
    """The rows of a global batch of ``batch_size`` that this process's devices hold, sorted
    (``None`` with one process: all of them). Each process reads and packs only these."""
    if mesh is None or mesh.size == 1 or jax.process_count() == 1:
        return None
    index = _batch_sharding(mesh, micro=False).addressable_devices_indices_map((batch_size, 1))
    return np.unique(np.concatenate([np.arange(batch_size)[i[0]] for i in index.values()]))


def place_batch(batch: Any, mesh: Any = None, *, micro: bool = True, rows: np.ndarray | None = None,
                batch_size: int | None = None) -> Any:  # fmt: skip
    """A host batch (arrays ``[A, B, S]``, or ``[B, S]`` with ``micro=False``; or a dict of
    them) as device arrays. With a mesh,
    global arrays whose rows are split over the batch axes the step splits them over: each
    process puts on its own devices only their rows (``jax.make_array_from_callback``), so the
    same code runs on one host and on many, where every process computes the same batch from
    (seed, step). ``rows``: the host batch holds only these rows of a global batch of
    ``batch_size`` (:func:`local_rows`: each process's own)."""
    if mesh is None or mesh.size == 1:
        return jax.tree.map(jnp.asarray, batch)
    sharding = _batch_sharding(mesh, micro)
    axis = 1 if micro else 0

    def place(x):
        x = np.asarray(x)
        if rows is None:
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
        shape = (*x.shape[:axis], batch_size, *x.shape[axis + 1 :])

        def shard(index):
            wanted = np.arange(batch_size)[index[axis]]
            at = np.searchsorted(rows, wanted)
            if np.any(at >= len(rows)) or np.any(rows[np.minimum(at, len(rows) - 1)] != wanted):
                raise ValueError(f"place_batch: rows {wanted.tolist()} were not read by this process (it has {rows.tolist()})")
            local = list(index)
            local[axis] = at
            return x[tuple(local)]

        return jax.make_array_from_callback(shape, sharding, shard)

    return jax.tree.map(place, batch)


def batches(data: Any, cfg: TrainConfig, start: int, rows: np.ndarray | None = None) -> Iterator[tuple[int, Any]]:
    """``(step, batch)`` from ``start``, ``batch`` the ``[A, B, S]`` stack of the data's
    micro-batches (token ids, or a dict of packed fields): a function of (seed, step) only.
    ``rows``: only these rows of each global batch (:func:`local_rows`)."""
    for step in range(start, cfg.steps):
        micro = [batch_rows(data, rows, cfg.seed, step * cfg.grad_accum + i, cfg.batch_size, cfg.seq_len)
                 for i in range(cfg.grad_accum)]  # fmt: skip
        yield step, jax.tree.map(lambda *xs: np.stack(xs), *micro)


def batch_rows(data: Any, rows: np.ndarray | None, *args: Any, **kwargs: Any) -> Any:
    """``data.batch(...)`` restricted to ``rows``: read only them where the data takes ``rows=``
    (zoo's data does), else the whole batch cut down."""
    if rows is None:
        return data.batch(*args, **kwargs)
    if "rows" in inspect.signature(data.batch).parameters:
        return data.batch(*args, rows=rows, **kwargs)
    return jax.tree.map(lambda x: np.asarray(x)[rows], data.batch(*args, **kwargs))
