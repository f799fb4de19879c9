"""TensorBoard event files: kept for code that imports them from here. Writing is
:class:`zoo.train.TensorBoardWriter`'s (tensorboardX); ``read_events`` reads a file back with
tensorboardX's own record CRC and ``Event`` protobuf (``tensorboard --logdir`` is the reader
for people)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from zoo.train.metrics import TensorBoardWriter


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a file as ``{"wall_time", "step", "file_version" | "session_log" | "scalars"}``, every
    record's CRCs checked (a ValueError names the record and offset)."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    data = Path(path).read_bytes()
    out: list[dict[str, Any]] = []
    at = 0
    while at < len(data):
        header, n = data[at : at + 8], struct.unpack("<Q", data[at : at + 8])[0]
        body = data[at + 12 : at + 12 + n]
        crcs = struct.unpack("<I", data[at + 8 : at + 12])[0], struct.unpack("<I", data[at + 12 + n : at + 16 + n])[0]
        if crcs != (masked_crc32c(header), masked_crc32c(body)):
            raise ValueError(f"{path}: record {len(out)} at byte {at} fails its CRC")
        ev = event_pb2.Event.FromString(body)
        entry: dict[str, Any] = {"wall_time": ev.wall_time, "step": ev.step}
        if ev.HasField("file_version"):
            entry["file_version"] = ev.file_version
        if ev.HasField("session_log"):  # START: TensorBoard drops earlier files' events from this step on
            entry["session_log"] = event_pb2.SessionLog.SessionStatus.Name(ev.session_log.status)
        if ev.HasField("summary"):
            entry["scalars"] = {v.tag: v.simple_value for v in ev.summary.value if v.HasField("simple_value")}
        out.append(entry)
        at += 16 + n
    return out


__all__ = ["TensorBoardWriter", "read_events"]
