"""Hugging Face checkpoint directories out (``save_pretrained``): the model's tensors in
safetensors files of the stored layout, written by every process of a mesh into a temporary
directory that is swapped into place whole (:mod:`zoo.hf.atomic`).

Everything model-specific comes from the model's parameter description (:mod:`zoo.params`):
which key holds each tensor, its stored layout, and which axis stacks layers or experts.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from zoo.core.layout import StageOrdered
from zoo.core.params import Param
from zoo.core.registry import family_of
from zoo.errors import CheckpointError, ConfigError
from zoo.hf.atomic import recover, swap_in, temp_dir, write_text
from zoo.hf.load import hf_config, read_generation_config
from zoo.hf.safetensors import safetensors_header, write_safetensors
from zoo.hf.stored import HostTensors, hf_layout

log = logging.getLogger("zoo")


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
    gathered to it in row blocks of at most :data:`~zoo.hf.stored.GATHER_BYTES`.

    ``generation_config.json`` gets the model config's BOS and EOS ids on top of the settings of
    ``generation_config`` (a dict, e.g. the source checkpoint's sampling settings) or, without
    one, of the file being saved over: its temperature, top_p and the rest are kept.
    """
    if isinstance(model, StageOrdered):
        raise ConfigError(
            f"save_pretrained: the model's layer stacks are in the stage order of {model.stages} pipeline stages x "
            f"{model.virtual} virtual stages; save zoo.parallel.to_stage_order(model, mesh, {model.virtual}, inverse=True)"
        )
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
    layout = hf_layout(model, specs, config.sizes, family.hf_duplicates(config))
    files: list[list[int]] = [[]]  # entries per file, filled up to max_shard_bytes
    size = 0
    for i, (_, shape, dtype, _, _) in enumerate(layout):
        nbytes = math.prod(shape) * dtype.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    host = HostTensors(model)
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
    recover(path)
    if generation_config is None:
        generation_config = read_generation_config(path)
    tmp = temp_dir(path, "config.json")
    try:
        hf = hf_config(model)
        write_text(tmp / "config.json", json.dumps(hf, indent=2) + "\n")
        gen = dict(generation_config or {})
        gen.update({k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf.get(k) is not None})
        if gen:
            write_text(tmp / "generation_config.json", json.dumps(gen, indent=2) + "\n")
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
        write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    return swap_in(tmp, path, _is_model_file)


_SHARED_CHECK = ".zoo-every-process-sees-this"


def _shared_directory(tmp: Path | None) -> Path | None | bool:
    """Every process: process 0's temporary directory (``tmp`` there) if every process sees it
    (a filesystem they share, checked with a token file), ``None`` if some do not (process 0
    then writes everything, gathering), ``False`` if process 0 has none (it failed to start)."""
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


def _write_own_shards(tmp: Path, files: list[list[int]], layout: list, file_layouts: list, host: HostTensors,
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


# A checkpoint's own files: a save replaces them; everything else in its directory stays.
_MODEL_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors.index.json"})

# The weight files a save writes: model.safetensors or model-00001-of-00003.safetensors. Other
# safetensors in the directory (model-orig.safetensors, a backup) are the user's and stay.
_WEIGHT_FILE = re.compile(r"model(?:-\d{5}-of-\d{5})?\.safetensors")


def _is_model_file(name: str) -> bool:
    return name in _MODEL_FILES or _WEIGHT_FILE.fullmatch(name) is not None
