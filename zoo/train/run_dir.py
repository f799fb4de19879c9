"""Run directories: what a run writes there (and ``config.json`` / ``run.json``, from which a
run's model is rebuilt), the lock a running run holds (``fcntl.flock`` on
``RUN_DIR/.lock``), and the rules for a directory that holds an earlier run (refused unless
resumed or overwritten; ``overwrite`` removes only the run's own files)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import jax

from zoo import lora
from zoo.errors import RunDirError
from zoo.hf.load import hf_config
from zoo.train.metrics import jsonable

# What a resume may change, and the schedule it keeps: zoo.train.resume's (here before it was).
from zoo.train.resume import FREE_ON_RESUME, check_resume, keep_schedule  # noqa: F401

# What a run writes into its run dir (and ``overwrite`` clears), and TensorBoard's event files.
EVENTS = "events.out.tfevents.*"
EXPORT_RECORD = "hf-export.json"
RUN_FILES = ("metrics.jsonl", "loss.png", "checkpoints", "damaged-checkpoints", "wandb", "run.json", EXPORT_RECORD)


# What zoo and orbax put in checkpoints/ and damaged-checkpoints/: step directories ("200",
# "200.1" for a second damaged copy) and orbax's unfinished ones ("200.orbax-checkpoint-tmp").
_STEP_ENTRY = re.compile(r"\d+(\.\d+)?(\.orbax-checkpoint-tmp.*)?")
_CHECKPOINT_DIRS = ("checkpoints", "damaged-checkpoints")


def _foreign_entries(run_dir: Path) -> list[Path]:
    """What a user put under the run's checkpoint folders: entries that are not step directories."""
    return [p for name in _CHECKPOINT_DIRS if (run_dir / name).is_dir()
            for p in sorted((run_dir / name).iterdir()) if not _STEP_ENTRY.fullmatch(p.name)]  # fmt: skip


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


def _trained(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` trained a step: a checkpoint, a loss curve, or a metric
    record past step 0. Files of a run that stopped before its first step are not a run."""
    if any((run_dir / name).is_dir() and any((run_dir / name).iterdir()) for name in _CHECKPOINT_DIRS):
        return True
    if (run_dir / "loss.png").is_file():
        return True
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            if json.loads(line).get("step", 0) >= 1:
                return True
        except (ValueError, AttributeError, TypeError):
            return True  # not ours to judge: kept, and the run refused
    return False


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
    if overwrite and (foreign := _foreign_entries(run_dir)):
        raise RunDirError(
            f"--overwrite would remove {run_dir}'s checkpoints, and they hold what is not the run's: "
            f"{', '.join(str(p) for p in foreign)}; move that elsewhere first (nothing was removed)"
        )
    if found and not (resume or overwrite) and _trained(run_dir):
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
            found = _previous_run(self.run_dir)
            untrained = bool(found) and not self.resume and not _trained(self.run_dir)
            if found and (self.overwrite or untrained):
                for name in found:
                    for path in self.run_dir.glob(name):
                        shutil.rmtree(path) if path.is_dir() else path.unlink()
                what = "the previous run's" if self.overwrite else "what a run that stopped before its first step left:"
                print(f"{'overwrite' if self.overwrite else 'run dir'}: removed {what} {', '.join(found)} from "
                      f"{self.run_dir}", flush=True)  # fmt: skip
        except BaseException:
            self.file.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


def record_export(run_dir: str | Path, target: str | Path) -> None:
    """Note in ``run_dir/hf-export.json`` (atomically; process 0) that this run writes its Hugging
    Face export to ``target``: a resume of the run may replace it, nothing else may unasked."""
    if jax.process_index() != 0:
        return
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{EXPORT_RECORD}.tmp"
    tmp.write_text(json.dumps({"path": str(Path(target).resolve())}) + "\n")
    os.replace(tmp, run_dir / EXPORT_RECORD)


def exported_to(run_dir: str | Path) -> Path | None:
    """Where the run in ``run_dir`` wrote its Hugging Face export (None: nowhere, or unknown)."""
    try:
        return Path(json.loads((Path(run_dir) / EXPORT_RECORD).read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def default_run_dir(checkpoint: str | None, model_type: str, preset: str) -> str:
    """``runs/MODEL-PRESET`` (``runs/llama-small``), or ``runs/NAME`` for a checkpoint ``.../NAME``."""
    if checkpoint:
        return str(Path("runs") / (Path(checkpoint).resolve().name or "checkpoint"))
    return str(Path("runs") / f"{model_type}-{preset}")


def latest_run(runs: str | Path) -> Path | None:
    """The run dir under ``runs`` whose ``metrics.jsonl`` changed last (None: none has one)."""
    logs = [p for p in Path(runs).glob("*/metrics.jsonl") if p.is_file()] if Path(runs).is_dir() else []
    return max(logs, key=lambda p: p.stat().st_mtime).parent if logs else None


def resume_target(flags: Any) -> str:
    """What ``--resume`` continues, in a line said before anything runs: the run in ``--run-dir``,
    by default the one of ``--model``/``--preset`` (or ``--checkpoint``), not the latest run of any
    model; where the latest run beside it is another, it is named."""
    checkpoint = getattr(flags, "checkpoint_id", None) or flags.checkpoint  # a hub id as given, not its snapshot
    if Path(flags.run_dir) != Path(default_run_dir(checkpoint, flags.model, flags.preset)):
        return f"--resume: continuing the run in {flags.run_dir} (--run-dir)"
    made = f"--checkpoint {checkpoint}" if checkpoint else f"--model {flags.model} --preset {flags.preset}"
    line = f"--resume: continuing the run in {flags.run_dir} (the run dir of {made}; another: --run-dir)"
    if (latest := latest_run(Path(flags.run_dir).parent)) and latest.resolve() != Path(flags.run_dir).resolve():
        line += f"; the latest run is {latest}: resume it with --run-dir {latest} and the flags it was made with"
    return line


def write_run_files(run_dir: Path, model: Any, settings: Mapping[str, Any]) -> None:
    """``run_dir/config.json`` (the model's Hugging Face config, as a save writes it) and
    ``run_dir/run.json`` (the run's settings), each written atomically. With LoRA adapters,
    ``config.json`` is the base model's."""
    for name, value in (("config.json", hf_config(lora.base_model(model))), ("run.json", jsonable(dict(settings)))):
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(value, indent=2) + "\n")
        os.replace(tmp, run_dir / name)
