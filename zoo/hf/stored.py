"""A model's tensors as a checkpoint stores them: their layout in the files, known from the
parameter description without reading any data (:func:`hf_layout`), and their values fetched
to the host one stored tensor at a time (:class:`HostTensors`), what a save streams or writes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import Array, Shaped

from zoo.core.params import Param, flatten
from zoo.core.registry import family_of
from zoo.hf.safetensors import DTYPES


class HostTensors:
    """A model's stored tensors on the host, one at a time. An array on one device is fetched
    once for all the tensors it stores (a layer stack: one per layer); a sharded one is gathered
    per stored tensor, every process taking part, in row blocks of at most :data:`GATHER_BYTES`
    where the stored layout is ours (an embedding, a head), so that no process holds more than
    a block beyond its shards: the blocks are written as they come."""

    def __init__(self, model: Any):
        self.arrays = flatten(model)
        specs, sizes = family_of(model).param_specs(model.config), model.config.sizes
        # Each parameter's own shape: arrays laid out on a mesh may carry padding after it.
        self.shapes = {path: specs[path].shape(sizes) for path in self.arrays}
        self._path, self._value = None, None  # the one parameter held for its stored tensors

    def _unpadded(self, path: str, idx: tuple[int, ...], value: np.ndarray) -> np.ndarray:
        """``value`` (stored tensor ``idx`` of ``path``, our layout) without the layout's padding."""
        true = self.shapes[path][len(idx) :]
        return value[tuple(slice(0, n) for n in true)] if value.shape != true else value

    def _held(self, path: str, fetch: Callable[[], Any]) -> Any:
        if self._path != path:
            self._path, self._value = path, fetch()
        return self._value

    def chunks(self, path: str, idx: tuple[int, ...], p: Param, sizes: Mapping[str, int], dtype: np.dtype
               ) -> Iterator[np.ndarray]:  # fmt: skip
        """The stored tensor ``idx`` of parameter ``path`` in the checkpoint's layout, as
        consecutive pieces of its bytes."""
        x = self.arrays[path]
        if not isinstance(x, jax.Array) or len(x.sharding.device_set) == 1:
            value = self._held(path, lambda: np.asarray(jax.device_get(x)))
            yield p.to_hf(self._unpadded(path, idx, value[idx]).astype(dtype, copy=False), sizes)
            return
        if x.sharding.memory_kind == "pinned_host":  # slicing computes: this parameter's shards to device
            x = self._held(path, lambda: jax.device_put(x, x.sharding.with_memory_kind("device")))
        shape = self.shapes[path][len(idx) :]
        if not x.is_fully_addressable and p.hf_layout_is_ours() and len(shape) > 1:
            # Across processes, in row blocks: every process receives each gathered block.
            rows = max(1, GATHER_BYTES // (math.prod(x.shape[len(idx) + 1 :]) * x.dtype.itemsize))
            part = x[idx] if idx else x
            for start in range(0, shape[0], rows):
                n = min(rows, shape[0] - start)
                block = host_value(_rows(part, jnp.int32(start), n))
                yield block[(slice(None), *(slice(0, k) for k in shape[1:]))].astype(dtype, copy=False)
            return
        yield p.to_hf(self._unpadded(path, idx, host_value(x[idx])).astype(dtype, copy=False), sizes)


    def own_blocks(self, path: str, idx: tuple[int, ...], dtype: np.dtype) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        """This process's part of stored tensor ``idx`` of ``path`` (our layout, without the stacked
        axes): ``(first index along each axis, block)`` per shard it holds replica 0 of."""
        x = self.arrays[path]
        if not isinstance(x, jax.Array):
            if jax.process_index() == 0:
                yield (0,) * (x.ndim - len(idx)), self._unpadded(path, idx, np.asarray(x[idx])).astype(dtype, copy=False)
            return
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            lead = [range(*s.indices(n)) for s, n in zip(shard.index, x.shape)]
            if not all(i in r for i, r in zip(idx, lead)):
                continue
            # A new array of the one stored tensor, read to the host (np.asarray of the shard itself
            # would keep a host copy of it with the model, off CPU: all of a process's shards).
            at = tuple(i - r.start for i, r in zip(idx, lead))
            corner = tuple(r.start for r in lead[len(idx) :])
            true = self.shapes[path][len(idx) :]
            if any(c >= n for c, n in zip(corner, true)):  # padding only
                continue
            if x.sharding.memory_kind == "pinned_host":  # already host memory (and slicing there would compute)
                part = np.asarray(shard.data)[at]
            else:
                part = np.asarray(shard.data[at] if idx else jnp.array(shard.data, copy=True))
            part = part[tuple(slice(0, n - c) for c, n in zip(corner, true))]  # padding cut off
            yield corner, part.astype(dtype, copy=False)


# The most a sharded save gathers at once across processes, beyond each process's shards.
GATHER_BYTES = 64 * 2**20


@functools.partial(jax.jit, static_argnums=2)
def _rows(x: jax.Array, start: jax.Array, n: int) -> jax.Array:
    """Rows ``start .. start + n`` of ``x`` (one compile for every block of a size)."""
    return jax.lax.dynamic_slice_in_dim(x, start, n)


def host_value(x: Shaped[Array, "*dims"] | Shaped[np.ndarray, "*dims"]) -> Shaped[np.ndarray, "*dims"]:
    """A global array's value on the host of every process (one process: from its devices)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _stored_dtype(x: Any) -> np.dtype:
    dtype = np.dtype(x.dtype)
    return dtype if dtype in DTYPES.values() else np.dtype(np.float32)


def hf_layout(model: Any, specs: Mapping[str, Param], sizes: Mapping[str, int], duplicates: Mapping[str, str]
               ) -> list[tuple[str, tuple[int, ...], np.dtype, str, tuple[int, ...]]]:  # fmt: skip
    """Every stored tensor of ``model`` in file order: (key, shape, dtype, parameter path, index
    along its stacked axes), known from the description without reading any data."""
    arrays = flatten(model)
    out = []
    for path, p in specs.items():
        if p.hf is None:
            continue
        for idx, key in p.hf_keys(sizes):
            out.append((key, p.hf_shape(sizes), _stored_dtype(arrays[path]), path, idx))
    for key, path in duplicates.items():
        out.append((key, specs[path].hf_shape(sizes), _stored_dtype(arrays[path]), path, ()))
    return out
