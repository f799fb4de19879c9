"""Run directories: what a run writes there (and ``config.json`` / ``run.json``, from which a
run's model is rebuilt), the lock a running run holds (``fcntl.flock`` on
``RUN_DIR/.lock``), and the rules for a directory that holds an earlier run (refused unless
resumed or overwritten; ``overwrite`` removes only the run's own files)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import jax


class RunDirError(ValueError):
    """A run directory in use by a running run, or holding an earlier run's files."""


# What a run writes into its run dir (and ``overwrite`` clears), and TensorBoard's event files.
EVENTS = "events.out.tfevents.*"
RUN_FILES = ("metrics.jsonl", "loss.png", "checkpoints", "damaged-checkpoints", "wandb", "run.json")


def _flock(f: IO[Any], run_dir: Path) -> None:
    """Take ``f``'s exclusive lock, or refuse: another run holds it."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RunDirError(
            f"run dir {run_dir} is in use by another run (it holds {run_dir / '.lock'}): "
            "wait for it to end or choose another run dir"
        ) from None


def _previous_run(run_dir: Path) -> list[str]:
    """The files of an earlier run that ``run_dir`` holds."""
    found = []
    for name in RUN_FILES:
        path = run_dir / name
        if (path.is_dir() and any(path.iterdir())) or (path.is_file() and path.stat().st_size > 0):
            found.append(name)
    if any(p.is_file() for p in run_dir.glob(EVENTS)):
        found.append(EVENTS)
    return found


def check_run_dir(run_dir: str | Path, *, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse (``RunDirError``) a run dir that a running run holds, or that holds an earlier
    run, unless ``resume`` (continue it) or ``overwrite`` (replace it). Reads only: the
    recipe calls it before any compiling; ``train`` checks again and takes the lock."""
    run_dir = Path(run_dir)
    _refuse_a_file(run_dir)
    if (run_dir / ".lock").is_file():
        with open(run_dir / ".lock") as f:  # closing releases it
            _flock(f, run_dir)
    _refuse_previous_run(run_dir, resume, overwrite)


def _refuse_a_file(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run dir {run_dir} is not a directory")


def _refuse_previous_run(run_dir: Path, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise RunDirError("resume and overwrite exclude each other: continue the run or replace it")
    found = _previous_run(run_dir) if run_dir.is_dir() else []
    if found and not (resume or overwrite):
        raise RunDirError(
            f"run dir {run_dir} holds a previous run ({', '.join(found)}): choose another one with --run-dir, "
            "continue that run with --resume (the same model and settings), or replace it with --overwrite"
        )


class RunDirLock:
    """The run dir, checked, cleared if ``overwrite``, and locked (``fcntl.flock`` on
    ``run_dir/.lock``) while the run lasts, so that a second run into it is refused.
    Only the first process of a multi-host run checks and locks (they share the dir)."""

    def __init__(self, run_dir: Path, resume: bool, overwrite: bool):
        self.run_dir, self.resume, self.overwrite, self.file = run_dir, resume, overwrite, None

    def __enter__(self) -> RunDirLock:  # noqa: PYI034 (beartype checks no typing.Self here)
        if jax.process_index() != 0:
            return self
        _refuse_a_file(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.run_dir / ".lock", "a")  # closed by __exit__
        _flock(self.file, self.run_dir)
        try:
            _refuse_previous_run(self.run_dir, self.resume, self.overwrite)
            if self.overwrite and (found := _previous_run(self.run_dir)):
                for name in found:
                    for path in self.run_dir.glob(name):
                        shutil.rmtree(path) if path.is_dir() else path.unlink()
                print(f"overwrite: removed the previous run's {', '.join(found)} from {self.run_dir}", flush=True)
        except BaseException:
            self.file.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


def write_run_files(run_dir: Path, model: Any, settings: Mapping[str, Any]) -> None:
    """``run_dir/config.json`` (the model's Hugging Face config, as a save writes it) and
    ``run_dir/run.json`` (the run's settings), each written atomically."""
    from zoo.hf.pretrained import hf_config
    from zoo.train.metrics import jsonable

    for name, value in (("config.json", hf_config(model)), ("run.json", jsonable(dict(settings)))):
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(value, indent=2) + "\n")
        os.replace(tmp, run_dir / name)
