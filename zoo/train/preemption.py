"""Stopping a run cleanly: on SIGTERM (a preemption notice: spot and preemptible machines,
Slurm, Kubernetes) or a first Ctrl-C, the loop finishes the step it is in, saves a checkpoint
at that step and raises :class:`Preempted`; ``--resume`` then continues exactly. Across
processes they agree on the step with JAX's preemption service
(``multihost_utils.reached_preemption_sync_point``, which catches SIGTERM itself)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

from zoo.train.checkpoints import newest


class Preempted(RuntimeError):
    """The run stopped on a signal (``signal``: its name) after saving a checkpoint at the step
    it reached (the message names it); ``--resume`` continues from there, batch for batch."""

    def __init__(self, message: str, signal: str = "SIGTERM"):
        super().__init__(message)
        self.signal = signal


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C: the run stopped at once; the message names the last checkpoint kept."""


class StopSignals:
    """While a run's steps go on, on one process: SIGTERM and a first SIGINT ask for a stop at
    the next step boundary; a second SIGINT stops at once (``KeyboardInterrupt``). Across
    processes: JAX's preemption service's SIGTERM, Python's own SIGINT. ``reached(step)`` says whether to stop after
    ``step``, every process saying the same."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.many = jax.process_count() > 1
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """The handlers, in place of the process's own until :meth:`restore`."""
        if threading.current_thread() is not threading.main_thread():  # handlers only install there
            return
        if self.many:  # SIGTERM is the preemption service's; a Ctrl-C in one process stops it alone
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.signal is not None:
            raise KeyboardInterrupt
        self.signal = name
        print(f"\n{name}: stopping after this step, with a checkpoint"
              + (" (Ctrl-C again: stop now, without one)" if signum == signal.SIGINT else ""),
              file=sys.stderr, flush=True)  # fmt: skip

    def reached(self, step: int) -> bool:
        if self.many:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal = self.signal or "SIGTERM"
                return True
            return False
        return self.signal is not None


def _kept(manager: Any, run_dir: Path | None) -> tuple[int | None, str]:
    """The newest checkpoint's step, and it in words (after any save in flight)."""
    if manager is None:
        return None, "nothing was saved (no run dir)"
    last = newest(manager, run_dir)  # a save that fails: SaveFailed, in one line
    return last, "there is no checkpoint" if last is None else f"checkpoint step {last} ({run_dir / 'checkpoints' / str(last)})"


def preempted_message(manager: Any, run_dir: Path | None, signal: str | None, step: int, steps: int) -> str:
    """What a run stopped by a signal after ``step`` (of ``steps``) saved."""
    last, kept = _kept(manager, run_dir)
    if last is None:
        return f"{signal}: stopped after step {step} of {steps}; {kept}"
    return f"{signal}: stopped after step {step} of {steps}; saved {kept}: --resume continues from it"


def interrupted_message(manager: Any, run_dir: Path | None, step: int) -> str:
    """What a run stopped at once (a second Ctrl-C) after ``step`` kept."""
    last, kept = _kept(manager, run_dir)
    if last is None:
        return f"interrupted after step {step}: {kept}"
    return f"interrupted after step {step}; the last checkpoint is {kept}: --resume continues from it"
