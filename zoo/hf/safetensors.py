"""Reading and writing the safetensors format, memory-mapped, FP8 included, writes atomic.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor name to
``{dtype, shape, data_offsets}``, then the raw bytes. Reading maps the file and returns views,
so a tensor is only read from disk when it is used.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

from zoo.errors import CheckpointError
from zoo.hf.atomic import umask

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
FLOATS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
# The reference implementation refuses longer headers; so do we, before allocating one.
MAX_HEADER_BYTES = 100_000_000


class SafetensorsFile:
    """One ``.safetensors`` file: its header, and tensors as read-only memory-mapped views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                raw = f.read(8)
                if len(raw) != 8:
                    raise self._error("not a safetensors file (shorter than its header length)")
                (n,) = struct.unpack("<Q", raw)
                # Checked before reading: a corrupt length would otherwise ask for exabytes.
                if n > MAX_HEADER_BYTES:
                    raise self._error(f"safetensors header length {n} is above the format's cap of {MAX_HEADER_BYTES}")
                if 8 + n > size:
                    raise self._error(f"truncated safetensors header (it claims {n} bytes, {size - 8} follow)")
                header = f.read(n)
        except OSError as e:
            raise self._error(f"cannot read ({e.strerror})") from None
        if len(header) != n:
            raise self._error(f"truncated safetensors header ({len(header)} of {n} bytes)")
        try:
            self.header: dict = json.loads(header.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise self._error(f"safetensors header is not UTF-8 (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise self._error(f"safetensors header is not valid JSON ({e})") from None
        if not isinstance(self.header, dict):
            raise self._error(f"safetensors header is a JSON {type(self.header).__name__}, not an object")
        self.metadata = self.header.pop("__metadata__", None) or {}
        if not (isinstance(self.metadata, dict) and all(isinstance(v, str) for v in self.metadata.values())):
            raise self._error(f"safetensors __metadata__ must map names to strings, got {self.metadata!r}")
        self._data_start = 8 + n
        self._check_layout(size - self._data_start)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._data_start else None

    def _error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def _check_layout(self, data_bytes: int) -> None:
        """What the format promises: known dtypes, spans sized by their shapes that tile the data exactly."""
        spans = []
        for name, info in self.header.items():
            if not isinstance(info, dict):
                raise self._error(f"tensor {name!r}: header entry is {info!r}, not an object")
            for field in ("dtype", "shape", "data_offsets"):
                if field not in info:
                    raise self._error(f"tensor {name!r}: header entry has no {field!r}")
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise self._error(f"tensor {name!r} has unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
            if not (isinstance(shape, list) and all(map(_is_count, shape))):
                raise self._error(f"tensor {name!r} has shape {shape!r}, not a list of non-negative ints")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
                raise self._error(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
            want = math.prod(shape) * DTYPES[dtype].itemsize
            if offsets[1] - offsets[0] != want:
                raise self._error(
                    f"tensor {name!r} has data_offsets {offsets} ({offsets[1] - offsets[0]} bytes), "
                    f"but shape {tuple(shape)} of {dtype} is {want} bytes"
                )
            spans.append((offsets[0], offsets[1], name))
        end, last = 0, None
        for begin, stop, name in sorted(spans):
            if begin < end:
                raise self._error(f"tensor {name!r} bytes {[begin, stop]} overlap {last!r}'s (ending at {end})")
            if begin > end:
                where = "before the first tensor" if last is None else f"after tensor {last!r}"
                raise self._error(f"tensor {name!r}: {begin - end} unused bytes {where} (spans must be contiguous)")
            if stop > data_bytes:
                raise self._error(
                    f"tensor {name!r} runs past the end of the file (bytes {[begin, stop]} of {data_bytes}; truncated?)"
                )
            end, last = stop, name
        if end != data_bytes:
            raise self._error(f"{data_bytes - end} bytes after the last tensor's data (the format allows none)")

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype_name(self, name: str) -> str:
        return self.header[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        begin, end = info["data_offsets"]  # checked on opening
        dtype = DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        if begin == end:
            return np.zeros(shape, dtype)
        raw = self._map[self._data_start + begin : self._data_start + end]
        return raw.view(dtype).reshape(shape)

    def release(self, name: str) -> None:
        """Drop the pages of tensor ``name`` that reading touched from this process's resident
        memory (they stay in the page cache; a later read maps them again). A sharded load
        reads one tensor's slices at a time, so its resident memory stays near its shards."""
        if self._map is None:
            return
        begin, end = (self._data_start + x for x in self.header[name]["data_offsets"])
        page = mmap.PAGESIZE
        start = begin // page * page
        stop = min(-(-end // page) * page, len(self._map))
        if stop > start:
            self._map._mmap.madvise(mmap.MADV_DONTNEED, start, stop - start)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def write_safetensors(
    path: str | Path,
    tensors: Iterable[tuple[str, np.ndarray]],
    metadata: Mapping[str, str] | None = None,
    *,
    layout: Sequence[tuple[str, tuple[int, ...], np.dtype]] | None = None,
) -> None:
    """Write ``(name, array)`` pairs to ``path`` atomically (a temporary file, then a rename).

    ``layout``: every tensor's ``(name, shape, dtype)`` in order, known before any data: the
    header is written first and each array as ``tensors`` yields it (or an iterator of its
    consecutive pieces), so only one piece is ever in memory (a sharded model's save gathers
    them one at a time). Without it, ``tensors`` is read whole first."""
    path = Path(path)
    if layout is None:
        items = [(name, np.ascontiguousarray(t)) for name, t in tensors]
        layout = [(name, tuple(t.shape), t.dtype) for name, t in items]
        tensors = items
    blob, _ = safetensors_header(path, layout, metadata)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 would outlive the rename
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            for (name, shape, dtype), (got, t) in zip(layout, tensors, strict=True):
                # An array, or an iterator of its consecutive pieces (each C-ordered, in order).
                pieces = [t] if isinstance(t, np.ndarray) else t
                nbytes = 0
                for piece in pieces:
                    piece = np.ascontiguousarray(piece)
                    if got != name or piece.dtype != np.dtype(dtype):
                        raise CheckpointError(f"{path}: tensor {got!r} of dtype {piece.dtype} is not the "
                                              f"{name!r} {np.dtype(dtype)} of its header")  # fmt: skip
                    f.write(piece.reshape(-1).view(np.uint8))  # no copy (bfloat16 and FP8 have no buffer format)
                    nbytes += piece.nbytes
                if nbytes != math.prod(shape) * np.dtype(dtype).itemsize:
                    raise CheckpointError(f"{path}: tensor {name!r} got {nbytes} bytes, its header's shape "
                                          f"{list(shape)} of {np.dtype(dtype)} is {math.prod(shape) * np.dtype(dtype).itemsize}")  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def safetensors_header(path: str | Path, layout: Sequence[tuple[str, tuple[int, ...], np.dtype]],
                       metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[int]]:  # fmt: skip
    """The bytes a safetensors file of ``layout`` (``(name, shape, dtype)`` in order) starts with
    (length and JSON header), and where each tensor's data starts in the file: the same for
    the same layout, so every process of a run can compute where its shards go."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset, starts = 0, []
    for name, shape, dtype in layout:
        dtype = np.dtype(dtype)
        if dtype not in NAMES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        starts.append(offset)
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data to 8 bytes, as the reference writer does
    blob = struct.pack("<Q", len(blob)) + blob
    return blob, [len(blob) + s for s in starts]


class CheckpointFiles:
    """All tensors of a checkpoint directory: one ``model.safetensors`` or a sharded index."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        self._files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if single.exists():  # as transformers does: the single file first, where both are present
            self.where = {k: single.name for k in self._file(single.name).keys()}
        elif index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:  # not JSON, not UTF-8, no weight_map
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            for name in sorted(set(weight_map.values())):
                if not (self.directory / name).exists():
                    raise CheckpointError(f"{index}: names shard {name!r}, which is not in {self.directory}")
            self.where = dict(weight_map)
        else:
            found = sorted(p.name for p in self.directory.glob("*.safetensors"))
            hint = f" (found {found}, but no model.safetensors.index.json)" if found else ""
            raise CheckpointError(f"{self.directory}: no model.safetensors or model.safetensors.index.json{hint}")
        for name, file in self.where.items():
            if name not in self._file(file).header:
                raise CheckpointError(f"{self.directory / file}: index lists tensor {name!r}, but the file lacks it")

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            self._files[name] = SafetensorsFile(self.directory / name)
        return self._files[name]

    def keys(self) -> set[str]:
        return set(self.where)

    def file_of(self, key: str) -> Path:
        return self.directory / self.where[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._file(self.where[key]).shape(key)

    def dtype_name(self, key: str) -> str:
        return self._file(self.where[key]).dtype_name(key)

    def get(self, key: str) -> np.ndarray:
        if key not in self.where:
            raise CheckpointError(f"{self.directory}: tensor {key!r} is missing from the checkpoint")
        return self._file(self.where[key]).get(key)

    def release(self, key: str) -> None:
        """:meth:`SafetensorsFile.release` for the file holding ``key``."""
        self._file(self.where[key]).release(key)
