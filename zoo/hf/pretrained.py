"""Hugging Face checkpoint directories in (``from_pretrained``) and out (``save_pretrained``).

Everything model-specific comes from the model's parameter description (:mod:`zoo.params`):
which key holds each tensor, its stored layout, and which axis stacks layers or experts.
"""

from __future__ import annotations

import dataclasses

import ctypes
import errno
import functools
import itertools
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zoo.errors import CheckpointError, ConfigError
from zoo.hf.safetensors import DTYPES, FLOATS, CheckpointFiles, safetensors_header, umask, write_safetensors
from zoo.params import Param, flatten
from zoo.registry import by_model_type, family_of

log = logging.getLogger("zoo")


_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}


def read_config(path: str | Path, **options) -> tuple[type, Any, dict[str, Any]]:
    """The model class, typed config and raw ``config.json`` of a checkpoint directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: a checkpoint is a directory with config.json and safetensors files")
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face checkpoint directory?)")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object")
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError(f"{cfg_path}: required field 'model_type' is missing")
    family = by_model_type(model_type, str(cfg_path))
    try:
        config = family.config_cls.from_hf(raw, source=str(cfg_path), **options)
    except ConfigError as e:
        if str(cfg_path) in str(e):
            raise
        raise ConfigError(f"{cfg_path}: {e}") from None  # a range check of the typed config: name the file too
    except TypeError as e:
        raise TypeError(f"from_pretrained: option not understood for model_type {model_type!r}: {e}") from None
    return family, dataclasses.replace(config, hf_extra=_unmodelled(family, raw, config, options)), raw


# What a save decides itself: the parameters' dtype (both spellings) and no quantization (an FP8
# checkpoint is saved dequantized).
_SAVE_WRITES = frozenset({"torch_dtype", "dtype", "quantization_config"})


def _unmodelled(family: type, raw: Mapping[str, Any], config: Any, options: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The fields of ``raw`` that ``config`` neither writes back (``to_hf``) nor reads: the
    config parsed without the field is the same config. A save keeps them as they were."""
    written = config.to_hf()
    out = []
    for key, value in raw.items():
        if key in written or key in _SAVE_WRITES:
            continue
        try:
            same = family.config_cls.from_hf({k: v for k, v in raw.items() if k != key}, **options) == config
        except (ConfigError, TypeError, ValueError, KeyError):
            same = False
        if same:
            out.append((key, json.dumps(value)))
    return tuple(out)


def _check_scale_shape(weight: tuple[int, ...], scale: tuple[int, ...], block: tuple[int, int], key: str,
                       file: Path) -> None:  # fmt: skip
    expected = (math.ceil(weight[0] / block[0]), math.ceil(weight[1] / block[1]))
    if tuple(scale) != expected:
        raise CheckpointError(
            f"{file}: {key}_scale_inv has shape {tuple(scale)}, expected {expected} "
            f"for weight {tuple(weight)} in {block[0]}x{block[1]} tiles"
        )


def _block_dequantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], key: str, file: Path, *,
                      check: bool = True) -> np.ndarray:  # fmt: skip
    """``w * scale_inv`` per ``block`` tile (tiles at the edges may be partial), in float32.
    ``check=False``: ``w`` is a block-aligned box of the weight and ``scale_inv`` its tiles."""
    rows, cols = w.shape
    if check:
        _check_scale_shape(w.shape, scale_inv.shape, block, key, file)
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return w.astype(np.float32) * scale


def _take(t: np.ndarray, indices: list[np.ndarray]) -> np.ndarray:
    """``t`` at the (ascending) ``indices`` of each axis, as a new array: the bounding box is
    sliced (a view of the memory-mapped file), then only the axes whose indices have gaps are
    gathered, so only the bytes of the box are touched."""
    box = t[tuple(slice(int(i[0]), int(i[-1]) + 1) for i in indices)]
    gathered = False
    for axis, i in enumerate(indices):
        if len(i) != int(i[-1]) - int(i[0]) + 1:
            box, gathered = np.take(box, i - i[0], axis=axis), True
    return box if gathered else np.array(box)


def _stored_indices(p: Param, sizes: Mapping[str, int], inner: tuple[slice, ...]) -> list[np.ndarray]:
    """For each axis of ``p``'s stored tensor, the indices that the slice ``inner`` of our
    layout (without the stacked axes) reads, ascending. A stored axis that merges letters
    (``"(H K)"``) reads the merged positions of their slices."""
    by_letter = dict(zip(p._inner(), inner))
    out = []
    for group in p.hf_groups():
        idx = np.zeros(1, np.int64)
        for letter in group:
            idx = (idx[:, None] * sizes[letter] + np.arange(sizes[letter])[by_letter[letter]][None, :]).ravel()
        out.append(idx)
    return out


def _load_sharded(source: _TensorSource, p: Param, sizes: Mapping[str, int], dtype: np.dtype,
                  sharding: jax.sharding.NamedSharding, padded: Mapping[str, int] | None = None) -> jax.Array:  # fmt: skip
    """One parameter as a global array laid out by ``sharding``, each of this process's devices
    given its shard read from the stored tensors' byte ranges it covers: one shard on the host
    at a time (devices with the same shard share one read). ``padded``: the letters' sizes as
    laid out (:func:`zoo.parallel.layout_sizes`): a shard's rows past the stored ones are zeros."""
    true, shape = p.shape(sizes), p.shape(padded or sizes)
    keys = dict(p.hf_keys(sizes))
    n = len(p.stacked)
    by_index: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        bounds = tuple(s.indices(dim)[:2] for s, dim in zip(index, shape))
        by_index.setdefault(bounds, []).append(device)
    arrays = []
    for bounds, devices in by_index.items():
        stored_bounds = [(min(a, t), min(b, t)) for (a, b), t in zip(bounds, true)]  # padding cut off
        region = [slice(a, b) for a, b in stored_bounds]
        sliced = {**sizes, **{letter: b - a for letter, (a, b) in zip(p._inner(), stored_bounds[n:])}}
        if any(a == b for a, b in stored_bounds):  # all padding
            host = np.zeros([b - a for a, b in bounds], dtype)
        elif n == 0:  # one stored tensor (embedding, head, norms): its slice is the shard, no second copy
            indices = _stored_indices(p, sizes, tuple(region[n:]))
            host = np.ascontiguousarray(p.from_hf(source.region(keys[()], indices), sliced), dtype=dtype)
        else:
            indices = _stored_indices(p, sizes, tuple(region[n:]))
            host = np.empty([b - a for a, b in stored_bounds], dtype)
            for local in itertools.product(*(range(b - a) for a, b in stored_bounds[:n])):
                stored = tuple(a + i for (a, _), i in zip(stored_bounds[:n], local))
                host[local] = p.from_hf(source.region(keys[stored], indices), sliced)
        if host.shape != tuple(b - a for a, b in bounds):
            host = np.pad(host, [(0, (b - a) - h) for (a, b), h in zip(bounds, host.shape)])
        for device in devices:
            arrays.append(jax.device_put(host, jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)))
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _count_nonfinite(t: np.ndarray) -> int:
    """How many values of ``t`` are NaN or infinite, counted in slices so no file-sized mask is made."""
    flat, step = t.reshape(-1), 1 << 24
    return sum(int(np.count_nonzero(~np.isfinite(flat[i : i + step]))) for i in range(0, flat.size, step))


class _TensorSource:
    """Tensors by key, dequantizing FP8 weights with their block scales as they are read."""

    def __init__(self, files: CheckpointFiles, raw_config: Mapping[str, Any], cfg_path: Path):
        self.files = files
        self.block: tuple[int, int] | None = None
        q = raw_config.get("quantization_config")
        if q is not None:
            method = q.get("quant_method")
            if method != "fp8":
                raise ConfigError(f"{cfg_path}: quantization_config.quant_method {method!r} is not supported (fp8)")
            block = q.get("weight_block_size")
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise ConfigError(f"{cfg_path}: quantization_config.weight_block_size must be two positive ints, got {block!r}")
            self.block = (block[0], block[1])

    def scale_keys(self) -> set[str]:
        return {k for k in self.files.keys() if k.endswith("_scale_inv")}

    def shape(self, key: str) -> tuple[int, ...]:
        return self.files.shape(key)

    def _read(self, key: str) -> np.ndarray:
        t = self.files.get(key)
        bad = _count_nonfinite(t)
        if bad:
            file = self.files.file_of(key)
            log.warning("%s: tensor %r has %d non-finite values (NaN or infinite) of %d", file, key, bad, t.size)
        return t

    def region(self, key: str, indices: list[np.ndarray]) -> np.ndarray:
        """The part of stored tensor ``key`` at ``indices`` (ascending indices per stored axis),
        FP8 weights dequantized over the blocks it touches only; then its pages are released."""
        t = self.files.get(key)
        if self.files.dtype_name(key).startswith("F8_"):
            scale_key = self._check_fp8(key)
            scale = self.files.get(scale_key)
            _check_scale_shape(t.shape, scale.shape, self.block, key, self.files.file_of(key))
            (r0, r1), (c0, c1) = ((int(i[0]) // b * b, min(-(-(int(i[-1]) + 1) // b) * b, n))
                                  for i, b, n in zip(indices, self.block, t.shape))  # fmt: skip
            box = _block_dequantize(np.asarray(t[r0:r1, c0:c1]),
                                    np.asarray(scale[r0 // self.block[0] : -(-r1 // self.block[0]),
                                                     c0 // self.block[1] : -(-c1 // self.block[1])]),
                                    self.block, key, self.files.file_of(key), check=False)  # fmt: skip
            out = _take(box, [indices[0] - r0, indices[1] - c0])
            self.files.release(scale_key)
        else:
            out = _take(t, indices)
        self.files.release(key)
        bad = _count_nonfinite(out)
        if bad:
            log.warning("%s: tensor %r has %d non-finite values (NaN or infinite) in the part this process reads",
                        self.files.file_of(key), key, bad)  # fmt: skip
        return out

    def _check_fp8(self, key: str) -> str:
        """The scale tensor's key of FP8 weight ``key``, or a ``CheckpointError`` saying what is wrong."""
        scale_key = key + "_scale_inv"
        if self.block is None:
            raise CheckpointError(
                f"{self.files.file_of(key)}: {key} is {self.files.dtype_name(key)} but config.json has no quantization_config"
            )
        if scale_key not in self.files.keys():
            raise CheckpointError(f"{self.files.file_of(key)}: FP8 weight {key} has no scale tensor {scale_key}")
        stored = self.files.dtype_name(scale_key)
        if stored not in FLOATS or stored.startswith("F8_"):
            raise CheckpointError(
                f"{self.files.file_of(scale_key)}: scale tensor {scale_key!r} is stored as {stored}, "
                f"but a block scale is floating point (F32, BF16, F16 or F64)"
            )
        return scale_key

    def get(self, key: str) -> np.ndarray:
        t = self._read(key)
        if self.files.dtype_name(key).startswith("F8_"):
            scale_key = self._check_fp8(key)
            return _block_dequantize(t, self._read(scale_key), self.block, key, self.files.file_of(key))
        return t


def load_arrays(
    source: _TensorSource,
    specs: Mapping[str, Param],
    sizes: Mapping[str, int],
    dtype,
    skipped: set[str] = frozenset(),
    shardings: Mapping[str, jax.sharding.NamedSharding] | None = None,
    padded: Mapping[str, int] | None = None,
) -> dict[str, jax.Array]:
    """Read every parameter, stacking per-layer / per-expert tensors into one array each.

    Each parameter is assembled in one host buffer and moved to the device before the next
    is read, so the host never holds more than one parameter beyond the memory-mapped files.
    With ``shardings`` (path -> ``NamedSharding``), each process reads only its devices' shards
    (:func:`_load_sharded`), into the letters' ``padded`` sizes where given.
    """
    files = source.files
    expected = {key for p in specs.values() if p.hf for _, key in p.hf_keys(sizes)}
    present = files.keys() - source.scale_keys() - set(skipped)
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{files.directory}: tensor {missing[0]!r} is missing{more}: {missing[:5]}")
    if extra:
        raise CheckpointError(
            f"{files.file_of(extra[0])}: unexpected tensor {extra[0]!r} "
            f"(the config does not describe it){f'; {len(extra)} such tensors' if len(extra) > 1 else ''}"
        )
    np_dtype = np.dtype(jnp.dtype(dtype))
    out = {}
    for path, p in specs.items():
        if p.hf is None:
            continue
        want = p.hf_shape(sizes)
        for _, key in p.hf_keys(sizes):
            if tuple(files.shape(key)) != want:
                raise CheckpointError(
                    f"{files.file_of(key)}: tensor {key!r} has shape {tuple(files.shape(key))}, expected {want}"
                )
            stored = files.dtype_name(key)
            if stored not in FLOATS:  # every parameter is floating point; integers would be cast silently
                raise CheckpointError(
                    f"{files.file_of(key)}: tensor {key!r} is stored as {stored}, but its parameter is "
                    f"floating point ({np_dtype}); a float weight cannot be {stored}"
                )
        if shardings is not None:
            out[path] = _load_sharded(source, p, sizes, np_dtype, shardings[path], padded)
            continue
        buf = np.empty(p.shape(sizes), np_dtype)
        for idx, key in p.hf_keys(sizes):
            buf[idx] = p.from_hf(source.get(key), sizes)
        out[path] = jax.device_put(buf)
        del buf
    return out


def from_pretrained(path: str | Path, *, dtype=None, compute_dtype=None, attention: str | None = None, mesh=None,
                    memory_kind: str | None = None, **options):  # fmt: skip
    """Load a Hugging Face checkpoint directory (``config.json`` + safetensors) as a zoo model.

    mesh: a :func:`zoo.parallel.make_mesh` mesh: every parameter is created directly with the
        sharding :func:`zoo.parallel.partition_specs` gives it, each process reading from the
        files only its devices' shards (memory-mapped byte ranges; layout changes, stacking and
        FP8 dequantisation per slice), so no process ever holds the whole model. Call it in
        every process of a multi-host run. ``memory_kind``: with a mesh, where the parameters
        live (``"pinned_host"`` keeps them in host memory).

    dtype: parameter dtype; default the checkpoint's own (``torch_dtype`` / ``dtype`` in
        config.json), float32 if it names none. FP8 weights are dequantized to it.
    compute_dtype: activations' dtype; default ``dtype``.
    attention: the attention path (``zoo.layers.attention``: "auto", "xla", "blockwise", "cudnn",
        "splash", "pallas_gpu").
    options: model-specific, e.g. ``mtp=True`` for DeepSeek-V3's multi-token-prediction layers.
    """
    path = Path(path)
    _recover(path)
    family, config, raw = read_config(path, **options)
    if attention is not None:
        config = dataclasses.replace(config, attention=attention)
    if dtype is None:
        name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        dtype = _DTYPE_NAMES.get(name, jnp.float32)
    compute_dtype = dtype if compute_dtype is None else compute_dtype
    files = CheckpointFiles(path)
    source = _TensorSource(files, raw, path / "config.json")
    specs = family.param_specs(config)
    try:
        family.hf_check(config, files.keys())
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    skipped = family.hf_skipped(config, files.keys())
    if skipped:
        log.info("%s: skipping %d tensors not used by this model (%s ...)", path, len(skipped), sorted(skipped)[0])
    copies = set(family.hf_duplicates(config)) & files.keys()
    shardings = padded = None
    if mesh is not None:
        from zoo import parallel

        parallel.validate_mesh(mesh, config)
        shardings = parallel.param_shardings(config, mesh, memory_kind=memory_kind)
        padded = parallel.layout_sizes(config, mesh)
    elif memory_kind is not None:
        raise TypeError("from_pretrained: memory_kind= goes with mesh= (without one, use zoo.placement.tree_placement)")
    arrays = load_arrays(source, specs, config.sizes, dtype, skipped | copies, shardings, padded)
    return family(config, arrays=arrays, param_dtype=dtype, compute_dtype=compute_dtype)


class _HostTensors:
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
                block = _gather(_rows(part, jnp.int32(start), n))
                yield block[(slice(None), *(slice(0, k) for k in shape[1:]))].astype(dtype, copy=False)
            return
        yield p.to_hf(self._unpadded(path, idx, _gather(x[idx])).astype(dtype, copy=False), sizes)


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


def _gather(x: jax.Array) -> np.ndarray:
    """A global array's value on the host of every process (one process: from its devices)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _stored_dtype(x: Any) -> np.dtype:
    dtype = np.dtype(x.dtype)
    return dtype if dtype in DTYPES.values() else np.dtype(np.float32)


def _hf_layout(model: Any, specs: Mapping[str, Param], sizes: Mapping[str, int], duplicates: Mapping[str, str]
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


def save_pretrained(
    model, path: str | Path, *, max_shard_bytes: int = 5 * 2**30, generation_config: Mapping[str, Any] | None = None
) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory that ``transformers`` loads.

    Shards above ``max_shard_bytes`` go to numbered files with a ``model.safetensors.index.json``.
    The directory appears complete or not at all: it is written under a temporary name and
    swapped into place. Saving over an existing checkpoint replaces its model files (config,
    safetensors, index) and keeps everything else in it (tokenizer, README, subfolders).

    A sharded model (on a mesh, over many processes too): call it in every process; the files
    are those of an unsharded save. On one process the tensors are fetched one at a time and
    streamed into the files. Across processes sharing the directory's filesystem (checked),
    process 0 lays the files out and every process writes its own shards' bytes into them
    (nothing is gathered); where they share none, process 0 writes everything, each tensor
    gathered to it in row blocks of at most :data:`GATHER_BYTES`.

    ``generation_config.json`` gets the model config's BOS and EOS ids on top of the settings of
    ``generation_config`` (a dict, e.g. the source checkpoint's sampling settings) or, without
    one, of the file being saved over: its temperature, top_p and the rest are kept.
    """
    try:
        family = family_of(model)
    except TypeError as e:
        raise TypeError(f"save_pretrained: {e}") from None
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"save_pretrained: max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
    config = model.config
    path = Path(os.path.abspath(path))  # "." and "..": a directory with a name, to write beside
    if path.is_symlink():
        path = path.resolve()  # replace what the link names, keeping the link
    check_save_path(path)
    specs = family.param_specs(config)
    layout = _hf_layout(model, specs, config.sizes, family.hf_duplicates(config))
    files: list[list[int]] = [[]]  # entries per file, filled up to max_shard_bytes
    size = 0
    for i, (_, shape, dtype, _, _) in enumerate(layout):
        nbytes = math.prod(shape) * dtype.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    host = _HostTensors(model)
    file_layouts = [[layout[i][:3] for i in entries] for entries in files]

    def tensors(entries: list[int]) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
        for i in entries:
            key, _, dtype, param, idx = layout[i]
            yield key, host.chunks(param, idx, specs[param], config.sizes, dtype)

    first, many = jax.process_index() == 0, jax.process_count() > 1
    tmp, failure = None, None
    if first:
        try:
            tmp = _begin_save(path, model, generation_config)
        except BaseException as e:  # the others are told before it is raised
            failure = e
    shared = _shared_directory(tmp) if many else None
    if failure is not None:
        raise failure
    if shared is False:
        raise CheckpointError(f"{path}: process 0 could not start the save (its log says why)")
    direct, tmp = shared is not None, shared or tmp
    retired = None
    try:
        if direct:  # every process writes its own shards' bytes into files process 0 laid out
            if first:
                for k, entries in enumerate(file_layouts):
                    _lay_out(tmp / f"shard-{k}.tmp", entries)
            _agree(True, path, "laid out the files")
            _agree(_try(lambda: _write_own_shards(tmp, files, layout, file_layouts, host, specs, config.sizes)),
                   path, "wrote its shards")  # fmt: skip
        elif many and not first:  # the others take part in every gather, in the same order
            for entries in files:
                for _, chunks in tensors(entries):
                    for _ in chunks:
                        pass
        else:  # streamed: each tensor written as it is gathered, one in memory at a time
            for k, entries in enumerate(files):
                write_safetensors(tmp / f"shard-{k}.tmp", tensors(entries), layout=file_layouts[k])
        if first:
            retired = _install(tmp, path, [[layout[i][0] for i in entries] for entries in files],
                               sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, _, _ in layout))  # fmt: skip
    except BaseException as e:
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, _AnotherProcessFailed):  # this one failed: the others, waiting on it, raise too
            _agree(False, path, "")
        raise
    _agree(True, path, "saved")  # every process returns once the checkpoint is in place
    if retired is not None:
        try:
            shutil.rmtree(retired)
        except OSError as e:  # the new checkpoint is in place; the next save retries the removal
            log.warning("%s: saved, but could not remove the previous checkpoint at %s (%s)", path, retired, e)


def check_save_path(path: str | Path) -> None:
    """Refuse (``CheckpointError``, naming it) a path a checkpoint cannot be saved to: a file, or
    one under a file. What ``save_pretrained`` checks first; a recipe checks before training."""
    path = Path(os.path.abspath(path))
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: exists and is not a directory; a checkpoint is one, so not replacing it")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"{path}: cannot be made, {parent} is a file")
            break
    if path == Path(path.anchor):
        raise CheckpointError(f"{path}: a checkpoint cannot replace the filesystem's root")


def _begin_save(path: Path, model: Any, generation_config: Mapping[str, Any] | None) -> Path:
    """Process 0: the temporary directory beside ``path`` a save writes into, with the
    config files in it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path)
    if generation_config is None:
        generation_config = read_generation_config(path)
    # The pid in the name tells a later save whether the process writing it is still alive.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp's 0700 would outlive the rename
        _remove_stale(path, tmp)
        hf = hf_config(model)
        _write_text(tmp / "config.json", json.dumps(hf, indent=2) + "\n")
        gen = dict(generation_config or {})
        gen.update({k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf.get(k) is not None})
        if gen:
            _write_text(tmp / "generation_config.json", json.dumps(gen, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _install(tmp: Path, path: Path, shard_keys: list[list[str]], total: int) -> Path | None:
    """Process 0: name the written files, index them, carry over the old checkpoint's other
    files and swap ``tmp`` into place; returns the previous checkpoint's directory, to remove."""
    n = len(shard_keys)
    if n == 1:
        os.replace(tmp / "shard-0.tmp", tmp / "model.safetensors")
    else:
        weight_map = {}
        for i, keys in enumerate(shard_keys):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp / f"shard-{i}.tmp", tmp / name)
            weight_map.update({k: name for k in keys})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    if path.exists():
        _carry_over(path, tmp)
    _fsync_dir(tmp)
    if not path.exists():
        os.rename(tmp, path)
        retired = None
    elif _exchange(tmp, path):
        retired = tmp  # now the previous checkpoint
    else:
        # No atomic exchange here: two renames, and a load finding only .NAME.old restores it.
        retired = path.with_name(f".{path.name}.old")
        os.rename(path, retired)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(retired, path)
            raise
    _fsync_dir(path.parent)
    return retired


_SHARED_CHECK = ".zoo-every-process-sees-this"


def _shared_directory(tmp: Path | None) -> Path | None | bool:
    """Every process: process 0's temporary directory (``tmp`` there) if every process sees it
    (a filesystem they share, checked with a token file), ``None`` if some do not (process 0
    then writes everything, gathering), ``False`` if process 0 has none (it failed to start)."""
    from jax.experimental import multihost_utils

    token, failure = os.urandom(16).hex(), None
    text = (f"{tmp}\0{token}" if tmp is not None else "").encode()
    if tmp is not None:
        try:  # (process 0 tells the others before raising: none waits on it)
            if len(text) > _NAME_BYTES:
                raise CheckpointError(f"{tmp}: a path over {_NAME_BYTES - 33} bytes is too long to share across processes")
            (tmp / _SHARED_CHECK).write_text(token)
        except (OSError, CheckpointError) as e:
            failure, text = e, b""
    sent = np.frombuffer(text.ljust(_NAME_BYTES, b"\0"), np.uint8)  # empty: "no save"
    name, _, token = bytes(multihost_utils.broadcast_one_to_all(sent)).rstrip(b"\0").decode().partition("\0")
    if failure is not None:  # (process 0 only: the others were sent no name)
        shutil.rmtree(tmp, ignore_errors=True)
        raise failure
    if not name:
        return False
    try:
        seen = (Path(name) / _SHARED_CHECK).read_text() == token
    except OSError:
        seen = False
    everyone = _agree(seen, Path(name), "")
    if jax.process_index() == 0:
        (Path(name) / _SHARED_CHECK).unlink()
    return Path(name) if everyone else None


_NAME_BYTES = 4096


def _agree(ok: bool, path: Path, what: str) -> bool:
    """Every process: whether all of them are ``ok``; with ``what``, raise naming the first that
    is not (so that no process waits forever on one that failed)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.array([int(ok)], np.int32))).reshape(-1)
    if what and not flags.all():
        raise _AnotherProcessFailed(f"{path}: process {int(np.argmin(flags))} failed before it {what}; nothing was saved")
    return bool(flags.all())


class _AnotherProcessFailed(CheckpointError):
    """Raised by every process at the agreement where one of them reported a failure (so none
    meets the others at a further one)."""


def _try(fn: Callable[[], None]) -> bool:
    try:
        fn()
    except Exception:
        log.exception("zoo.save_pretrained: this process's part of the save failed")
        return False
    return True


def _lay_out(file: Path, layout: list[tuple[str, tuple[int, ...], np.dtype]]) -> None:
    """Process 0: a safetensors file's header, and its full size (the data written later)."""
    blob, starts = safetensors_header(file, layout)
    size = starts[-1] + math.prod(layout[-1][1]) * np.dtype(layout[-1][2]).itemsize if layout else len(blob)
    with open(file, "wb") as f:  # (created with 0o666 & ~umask, as the others' files are)
        f.write(blob)
        f.truncate(size)


def _write_own_shards(tmp: Path, files: list[list[int]], layout: list, file_layouts: list, host: _HostTensors,
                      specs: Mapping[str, Param], sizes: Mapping[str, int]) -> None:  # fmt: skip
    """Every process: the bytes of the shards it holds (replica 0 of each) into the laid-out
    files, with positioned writes, then synced: no process gathers anything."""
    for k, entries in enumerate(files):
        _, starts = safetensors_header(tmp / f"shard-{k}.tmp", file_layouts[k])
        fd = os.open(tmp / f"shard-{k}.tmp", os.O_WRONLY)
        try:
            for i, start in zip(entries, starts, strict=True):
                _, _, dtype, param, idx = layout[i]
                for box, block in host.own_blocks(param, idx, dtype):
                    _write_box(fd, start, block, box, specs[param], sizes)
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_box(fd: int, start: int, block: np.ndarray, box: tuple[int, ...], p: Param,
               sizes: Mapping[str, int]) -> None:  # fmt: skip
    """``block`` (our layout, without the stacked axes), at ``box`` (its first index along each
    axis), into the stored tensor whose data starts at byte ``start``: one write per run of
    consecutive stored bytes."""
    flat = [a for g in p.hf_groups() for a in g]
    inner = p._inner()
    order = [inner.index(a) for a in flat]
    block = block.transpose(order)
    corner = [box[i] for i in order]
    dims = [sizes[a] for a in flat]
    strides = [math.prod(dims[d + 1 :]) * block.itemsize for d in range(len(dims))]
    whole = len(dims)  # the axes from here on are whole in the block: each run spans them
    while whole > 0 and block.shape[whole - 1] == dims[whole - 1]:
        whole -= 1
    outer = max(whole - 1, 0)  # one run per index of the axes before the partial one
    base = start + sum(c * s for c, s in zip(corner, strides, strict=True))
    for at in itertools.product(*(range(n) for n in block.shape[:outer])):
        run = np.ascontiguousarray(block[at]).reshape(-1).view(np.uint8)
        offset = base + sum(i * s for i, s in zip(at, strides, strict=False))
        written = 0
        while written < run.nbytes:  # pwrite may write less than asked
            written += os.pwrite(fd, run[written:], offset + written)


def hf_config(model: Any) -> dict[str, Any]:
    """The ``config.json`` of ``model``: its config's fields, the source's fields it does not
    model (``config.hf_extra``), and the dtype of its parameters."""
    config = model.config
    out = config.to_hf()
    out.update({k: json.loads(v) for k, v in config.hf_extra if k not in out})
    out["torch_dtype"] = out["dtype"] = str(np.dtype(model.embed.dtype))
    return out


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """A checkpoint directory's ``generation_config.json`` (``{}`` when it has none)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        value = None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: not a JSON object; fix or remove it (a save keeps its generation settings)")
    return value


# A checkpoint's own files: a save replaces them; everything else in its directory stays.
_MODEL_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors.index.json"})
# What save_pretrained's tempfile.mkdtemp names look like after ".NAME." (older saves had no pid).
_TMP_NAME = re.compile(r"(?:(\d+)\.)?[a-z0-9_]{8}\.tmp")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


# The weight files a save writes: model.safetensors or model-00001-of-00003.safetensors. Other
# safetensors in the directory (model-orig.safetensors, a backup) are the user's and stay.
_WEIGHT_FILE = re.compile(r"model(?:-\d{5}-of-\d{5})?\.safetensors")


def _is_model_file(name: str) -> bool:
    return name in _MODEL_FILES or _WEIGHT_FILE.fullmatch(name) is not None


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_or_copy(src, dst) -> None:
    """Hard-link ``src`` to ``dst`` (instant, no extra space); copy where the filesystem refuses."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)  # the original is deleted after the swap
        finally:
            os.close(fd)


def _carry_over(old: Path, new: Path) -> None:
    """Put everything of ``old`` that is not the model's own (tokenizer, README, subfolders) into ``new``."""
    for p in old.iterdir():
        if _is_model_file(p.name):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, new / p.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(p, new / p.name)


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where unsupported."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):  # old kernel, or the filesystem lacks it
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _recover(path: Path) -> None:
    """Put back the checkpoint a save killed between its two renames left only as ``.NAME.old``."""
    old = path.with_name(f".{path.name}.old")
    if not os.path.lexists(path) and old.is_dir() and not old.is_symlink():
        try:
            os.rename(old, path)
        except OSError as e:
            raise CheckpointError(
                f"{path}: missing; an interrupted save left it at {old}, which cannot be moved back ({e.strerror})"
            ) from None
        log.warning("%s: restored the checkpoint from %s, where an interrupted save had left it", path, old)


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # not our own directory, so an earlier process's with our pid (containers reuse them)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _remove_stale(path: Path, ours: Path) -> None:
    """Remove what killed saves to ``path`` left beside it: temporary directories older than ours whose
    process is gone, and a ``.NAME.old`` previous checkpoint (stale, since ``path`` exists)."""
    since = ours.stat().st_mtime_ns
    prefix = f".{path.name}."
    for p in path.parent.iterdir():
        if p == ours or not p.name.startswith(prefix) or p.is_symlink() or not p.is_dir():
            continue
        rest = p.name[len(prefix) :]
        if rest == "old" and (path / "config.json").exists():  # path is the complete checkpoint that replaced it
            why = "the previous checkpoint left by an interrupted save"
        elif (m := _TMP_NAME.fullmatch(rest)) and p.stat().st_mtime_ns < since and not (m[1] and _alive(int(m[1]))):
            why = "a temporary directory left by an interrupted save"
        else:
            continue
        try:
            shutil.rmtree(p)
        except OSError as e:
            log.warning("%s: could not remove %s, %s (%s)", path, p, why, e)
        else:
            log.warning("%s: removed %s, %s", path, p, why)
