"""Hugging Face checkpoint directories in (``from_pretrained``): ``config.json`` read into the
family's typed config, the safetensors files into its parameters (FP8 dequantized, each process
of a mesh reading only its shards).

Everything model-specific comes from the model's parameter description (:mod:`zoo.params`):
which key holds each tensor, its stored layout, and which axis stacks layers or experts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from zoo.core.layout import layout_sizes, param_shardings, validate_mesh
from zoo.core.params import Param, map_params
from zoo.core.registry import by_model_type
from zoo.errors import CheckpointError, ConfigError
from zoo.hf.atomic import recover
from zoo.hf.hub import resolve
from zoo.hf.safetensors import FLOATS, CheckpointFiles

log = logging.getLogger("zoo")


DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}


def read_config(path: str | Path, **options) -> tuple[type, Any, dict[str, Any]]:
    """The model class, typed config and raw ``config.json`` of a checkpoint directory (or of a
    Hugging Face hub id's snapshot, :func:`zoo.hf.hub.resolve`)."""
    path = resolve(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: a checkpoint is a directory with config.json and safetensors files")
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face checkpoint directory?)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:  # not JSON, not UTF-8 (a damaged file), a directory, unreadable
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
            arrays.append(jax.device_put(host, jax.sharding.make_single_device_sharding(device, memory_kind=sharding.memory_kind)))
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
    convert: Convert | None = None,
) -> dict[str, jax.Array]:
    """Read every parameter, stacking per-layer / per-expert tensors into one array each.

    Each parameter is assembled in one host buffer and moved to the device before the next
    is read, so the host never holds more than one parameter beyond the memory-mapped files.
    With ``shardings`` (path -> ``NamedSharding``), each process reads only its devices' shards
    (:func:`_load_sharded`), into the letters' ``padded`` sizes where given. ``convert``: what a
    parameter becomes instead of a device array, made from its host buffer (``None``: the array).
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
        converted = None if convert is None else convert(path, p, sizes, buf)
        out[path] = jax.device_put(buf) if converted is None else converted
        del buf
    return out


# ``(path, parameter, sizes, host buffer) -> leaf or None``: a parameter made other than as a
# device array of its values (zoo.lora.quantized: a layer stack's weight quantized on the host).
Convert = Callable[[str, Param, Mapping[str, int], np.ndarray], Any]


def from_pretrained(path: str | Path, *, dtype=None, compute_dtype=None, attention: str | None = None, mesh=None,
                    memory_kind: str | None = None, convert: Convert | None = None, **options):  # fmt: skip
    """Load a Hugging Face checkpoint directory (``config.json`` + safetensors) as a zoo model;
    ``path`` may be a hub id (``"org/name"``, no local folder), fetched into the hub cache by
    ``huggingface_hub`` (the ``hf`` extra; ``HF_HUB_OFFLINE=1``: from the cache only).

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
    convert: what a parameter becomes instead of a device array, from its host buffer (one at a
        time, as loaded; ``None`` for the array): ``zoo.lora.quantized.from_pretrained`` quantizes
        the layer stacks' weights so, and they never reach the device unquantized. Not with a mesh.
    options: model-specific, e.g. ``mtp=True`` for DeepSeek-V3's multi-token-prediction layers.
    """
    if convert is not None and mesh is not None:
        raise TypeError("from_pretrained: convert= is for one device (each parameter made whole on the host), not mesh=")
    path = Path(path)
    recover(path)
    path = resolve(path)  # a hub id ("org/name") that is no local folder: its snapshot in the hub cache
    family, config, raw = read_config(path, **options)
    if attention is not None:
        config = dataclasses.replace(config, attention=attention)
    if dtype is None:
        name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        dtype = DTYPE_NAMES.get(name, jnp.float32)
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
        if not isinstance(mesh, (Mesh, AbstractMesh)):
            raise TypeError(f"from_pretrained: mesh= takes a jax Mesh, got {type(mesh).__name__} {mesh!r}"
                            + (f" (build it with zoo.parallel.make_mesh({mesh!r}))" if isinstance(mesh, str) else ""))
        validate_mesh(mesh, config)
        shardings = param_shardings(config, mesh, memory_kind=memory_kind)
        padded = layout_sizes(config, mesh)
    elif memory_kind is not None:
        raise TypeError("from_pretrained: memory_kind= goes with mesh= (without one, use zoo.placement.tree_placement)")
    arrays = load_arrays(source, specs, config.sizes, dtype, skipped | copies, shardings, padded, convert)
    if all(isinstance(a, jax.Array) for a in arrays.values()):
        return family(config, arrays=arrays, param_dtype=dtype, compute_dtype=compute_dtype)
    # Some parameters converted: the model built from their shapes, then each leaf put in place.
    shapes = {k: jax.ShapeDtypeStruct(specs[k].shape(config.sizes), jnp.dtype(dtype)) for k in arrays}
    shell = eqx.filter_eval_shape(lambda a: family(config, arrays=a, param_dtype=dtype, compute_dtype=compute_dtype), shapes)
    return map_params(lambda name, _: arrays[name], shell)
