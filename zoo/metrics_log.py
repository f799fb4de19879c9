"""TensorBoard scalars without TensorBoard: a dependency-free ``tfevents`` writer.

    writer = TensorBoardWriter(run_dir)        # run_dir/events.out.tfevents.<time>.<host>.<pid>
    writer.scalars(step, {"loss": 1.2, "val_loss": 1.4})
    writer.close()

The file is what TensorFlow's summary writer produces: a sequence of records (little-endian
uint64 length, masked CRC-32C of the length, the data, masked CRC-32C of the data), each data an
``Event`` protocol buffer: first ``file_version: "brain.Event:2"``, then per call
``{wall_time, step, summary {value {tag, simple_value}}}``. ``tensorboard --logdir RUN_DIR``
reads it; so does :func:`read_events` (used by the tests).
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

_CRC_TABLE: list[int] = []


def _crc_table() -> list[int]:
    if not _CRC_TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
            _CRC_TABLE.append(c)
    return _CRC_TABLE


def crc32c(data: bytes) -> int:
    table, c = _crc_table(), 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # int64 fields are encoded as their two's complement
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(step: int, values: Mapping[str, float], wall_time: float | None = None) -> bytes:
    """An ``Event`` with a ``Summary`` of ``simple_value`` scalars."""
    summary = b"".join(
        _field(1, _field(1, tag.encode("utf-8")) + b"\x15" + struct.pack("<f", float(v))) for tag, v in values.items()
    )
    wall = time.time() if wall_time is None else wall_time
    return b"\x09" + struct.pack("<d", wall) + b"\x10" + _varint(int(step)) + _field(5, summary)


def record(data: bytes) -> bytes:
    """One tfrecord: length, its masked CRC, the data, its masked CRC."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


class TensorBoardWriter:
    """Scalars per step into an event file in ``run_dir`` (created if missing); each call is
    flushed, so TensorBoard follows a run live. Non-finite and non-scalar values are skipped."""

    def __init__(self, run_dir: str | Path):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self._f = open(self.path, "ab")  # noqa: SIM115 (closed by close())
        version = b"\x09" + struct.pack("<d", time.time()) + _field(3, b"brain.Event:2")
        self._f.write(record(version))
        self._f.flush()

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        kept = {}
        for k, v in values.items():
            try:
                x = float(v)
            except (TypeError, ValueError):
                continue
            if math.isfinite(x):
                kept[k] = x
        if kept and self._f is not None:
            self._f.write(record(event(step, kept)))
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> TensorBoardWriter:  # noqa: PYI034 (beartype checks no typing.Self here)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- reading back (tests, and a quick look without TensorBoard) --------------------------------


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a file as ``{"wall_time", "step", "file_version" | "scalars"}``, every
    record's CRCs checked (a ValueError names the record and offset)."""
    data = Path(path).read_bytes()
    out, at = [], 0
    while at < len(data):
        header = data[at : at + 8]
        (n,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[at + 8 : at + 12])
        body = data[at + 12 : at + 12 + n]
        (bcrc,) = struct.unpack("<I", data[at + 12 + n : at + 16 + n])
        if hcrc != masked_crc(header) or bcrc != masked_crc(body):
            raise ValueError(f"{path}: record {len(out)} at byte {at} fails its CRC")
        ev: dict[str, Any] = {"step": 0}
        for number, _, value in _fields(body):
            if number == 1:
                ev["wall_time"] = struct.unpack("<d", value)[0]
            elif number == 2:
                ev["step"] = value
            elif number == 3:
                ev["file_version"] = value.decode()
            elif number == 5:
                scalars = {}
                for _, _, v in _fields(value):
                    tag, x = None, None
                    for fn, _, fv in _fields(v):
                        if fn == 1:
                            tag = fv.decode("utf-8")
                        elif fn == 2:
                            x = struct.unpack("<f", fv)[0]
                    scalars[tag] = x
                ev["scalars"] = scalars
        out.append(ev)
        at += 16 + n
    return out
