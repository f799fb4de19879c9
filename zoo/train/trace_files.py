"""A run's profile on disk (``RUN_DIR/profile``, written by ``train(profile=...)``): the newest
session's ``*.xplane.pb`` traces, their events read by jax.profiler's own reader, and the
``step.json`` beside them. What does not read is a :class:`ProfileError` naming the file;
:mod:`zoo.train.trace_report` analyses the events."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jax.profiler import ProfileData


@dataclass(frozen=True)
class Event:
    """One timed event of the trace (nanoseconds)."""

    plane: str
    line: str
    name: str
    start: float
    end: float
    stats: dict[str, Any]

    @property
    def op(self) -> str:
        return str(self.stats.get("hlo_op", self.name))


class ProfileError(ValueError):
    """A run dir, trace or ``step.json`` that cannot be read as a profile; names the file."""


def find_traces(run_dir: str | Path) -> list[Path]:
    """The newest profiling session's ``*.xplane.pb`` files (one per host) under ``run_dir/profile``;
    a ``run_dir`` that is a file is a :class:`ProfileError`."""
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise ProfileError(f"{run_dir} is a file, not a run dir (one holding profile/, written by recipes/train.py "
                           "--profile START:STOP)")  # fmt: skip
    sessions = sorted(p for p in (Path(run_dir) / "profile" / "plugins" / "profile").glob("*") if p.is_dir())
    return sorted(sessions[-1].glob("*.xplane.pb")) if sessions else []


def read_events(path: str | Path) -> list[Event]:
    """Every event of an ``.xplane.pb`` trace, by jax.profiler's own reader; one that does not
    read (truncated, damaged) is a :class:`ProfileError` naming it."""
    try:
        data = ProfileData.from_file(str(path))
    except Exception as e:  # noqa: BLE001  (the reader raises what its protobuf parser raises)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ProfileError(f"{path}: not a readable trace ({why}); record it again with recipes/train.py "
                           "--profile START:STOP") from None  # fmt: skip
    return [Event(plane.name, line.name, e.name, e.start_ns, e.start_ns + e.duration_ns, dict(e.stats))
            for plane in data.planes for line in plane.lines for e in line.events]  # fmt: skip


def read_step_info(folder: str | Path) -> dict[str, Any]:
    """``folder/step.json`` (what the profiled step was: platform, placement, memory), ``{}``
    where there is none; one that does not read is a :class:`ProfileError` naming it."""
    path = Path(folder) / "step.json"
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ProfileError(f"{path}: does not read as JSON ({e})") from None
    if not isinstance(info, dict):
        raise ProfileError(f"{path}: holds a {type(info).__name__}, not the step's settings (a JSON object)")
    return info

