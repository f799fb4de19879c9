"""Training checkpoints: the orbax manager of a run dir, a save that first checks every array
is finite and records its bit sums (their restore, verified: ``zoo.train.restore``), a failed
save in one line (``SaveFailed``; ``quiet_closed_loops``), and ``NonFiniteLoss``, the guard's stop."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, UInt32

from zoo.errors import CheckpointError
from zoo.placement import tree_placement


class NonFiniteLoss(RuntimeError):
    """The loss, a metric, the parameters or the optimizer state became NaN or infinite.
    Nothing non-finite is written: the last checkpoint is good and left untouched."""


class _OrbaxSaveErrors(logging.Filter):
    """Drops orbax's log records of a failed background save (each with its traceback, hundreds
    of lines): the save's failure is raised in the loop as :class:`SaveFailed`, in one line."""

    SAID = ("raised an exception", "Failed to run", "Save Finalize thread", "Task exception was never retrieved")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not any(s in str(record.msg) for s in self.SAID):
            return True
        tb = record.exc_info[2] if record.exc_info else None
        where = record.pathname + "".join(f.f_code.co_filename for f, _ in traceback.walk_tb(tb))
        return "orbax" not in where and "orbax" not in record.getMessage()


_SAVE_ERRORS = _OrbaxSaveErrors()


def open_manager(run_dir: Path, keep: int) -> Any:
    """The orbax ``CheckpointManager`` of ``run_dir/checkpoints``: asynchronous saves, atomic
    (written under a temporary name, renamed when complete), the last ``keep`` kept."""
    import orbax.checkpoint as ocp

    for name in ("absl", "asyncio"):
        if _SAVE_ERRORS not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_SAVE_ERRORS)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
    return ocp.CheckpointManager(
        (run_dir / "checkpoints").absolute(), options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def stop_message(manager: Any, run_dir: Path | None, step: int, what: str) -> str:
    """Why a run stops at ``step``, and which checkpoint it leaves good (after any save in flight)."""
    last = newest(manager, run_dir) if manager is not None else None
    if last is not None:
        kept = f"the last good checkpoint (step {last}, {run_dir / 'checkpoints' / str(last)}) is untouched"
    else:
        kept = "there is no checkpoint" if manager is not None else "nothing was saved (no run dir)"
    return f"step {step}: {what}; stopping. Nothing non-finite was written: {kept}."


def save(manager: Any, run_dir: Path | None, step: int, tree: Any, *, on_host: bool) -> None:
    """Save ``tree`` (``{"params", "opt_state"}``) as checkpoint ``step``, with its arrays' bit
    sums; raises ``NonFiniteLoss`` (nothing written) if any array is not finite: the update can
    break what the loss did not show. ``on_host``: some of the tree is in pinned host memory."""
    import orbax.checkpoint as ocp

    finite, sums = audit(tree, to_device=on_host)
    if (bad := first_non_finite(tree, finite)) is not None:
        raise NonFiniteLoss(stop_message(manager, run_dir, step, f"the {bad} is not finite after the update"))
    checksums = dict(zip(named_leaves(tree), np.asarray(sums).tolist()))
    try:  # (waits for the save before it, whose failure surfaces here)
        manager.save(step, args=ocp.args.StandardSave(tree), custom_metadata={"zoo": {"checksums": checksums}}, force=True)
    except Exception as e:  # noqa: BLE001  (orbax and TensorStore raise plain Exceptions)
        raise SaveFailed(save_failure(manager, run_dir, e)) from None


def wait(manager: Any, run_dir: Path | None) -> None:
    """Wait for the save in flight; a failure as :class:`SaveFailed`, in one line."""
    try:
        manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001  (as above)
        raise SaveFailed(save_failure(manager, run_dir, e)) from None


def newest(manager: Any, run_dir: Path | None) -> int | None:
    """The newest complete checkpoint's step (None: none), after any save in flight."""
    wait(manager, run_dir)
    return manager.latest_step()


class SaveFailed(CheckpointError):
    """A checkpoint could not be written (a full disk ...); the message names the disk and the
    last good checkpoint, which is untouched."""


def quiet_closed_loops() -> None:
    """TensorStore's callbacks into the event loop of an orbax save that failed (a full disk)
    each report "RuntimeError: Event loop is closed" as an unraisable exception, from C, after
    the loop is gone: dropped (the failure itself is reported in one line); the rest as before."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
            return
        previous(unraisable)

    sys.unraisablehook = hook


def save_failure(manager: Any, run_dir: Path | None, e: BaseException) -> str:
    """What a failed save says: the error (the OS's, where it is one), the space left on that
    disk, and the newest complete checkpoint."""
    folder = (run_dir / "checkpoints") if run_dir is not None else Path(".")
    text = _short(e)
    if m := re.search(r"os_error_code='(\d+)'", str(e)):
        text = f"{os.strerror(int(m[1]))} (errno {m[1]})"
    try:
        free = f"{shutil.disk_usage(folder).free / 2**30:.1f} GiB free there"
    except OSError:
        free = "its free space unknown"
    try:  # a save still in flight (another than the one that failed) ends first
        manager.wait_until_finished()
    except Exception:  # noqa: BLE001  (the failed one, again)
        pass
    try:
        manager.reload()
        steps = [s for s in manager.all_steps() if (folder / str(s)).is_dir()]
    except Exception:  # noqa: BLE001
        steps = []
    kept = f"the last good checkpoint is step {max(steps)} ({folder / str(max(steps))})" if steps else "no checkpoint was kept"
    if jax.process_index() == 0:  # the failed save's unfinished directory (orbax renames only complete ones)
        for tmp in folder.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)
    return f"saving a checkpoint to {folder} failed: {text}; {free}. Nothing half-written remains; {kept}"


def close(manager: Any, run_dir: Path | None, *, quietly: bool) -> None:
    """Close the manager (waiting for a save in flight: an interrupted run keeps it); a failure
    as :class:`SaveFailed`, or, ``quietly`` (another error is on its way), not at all."""
    try:
        manager.close()
    except Exception as e:  # noqa: BLE001  (as above)
        if not quietly:
            raise SaveFailed(save_failure(manager, run_dir, e)) from None


def named_leaves(tree: Any) -> dict[str, Any]:
    """The array leaves of ``tree`` (arrays, shape structs, orbax metadata) by dotted path."""

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(map(_key_name, path)): x for path, x in leaves if hasattr(x, "shape") and hasattr(x, "dtype")}


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _params_first(names: Iterable[str]) -> list[str]:
    """Leaf names with the parameters' first: an error names a parameter where one is at fault."""
    return sorted(names, key=lambda name: not name.startswith("params."))


def _describe(name: str) -> str:
    """A leaf of ``{"params": ..., "opt_state": ...}`` as a person would name it."""
    return f"parameter {name.removeprefix('params.')}" if name.startswith("params.") else f"optimizer state {name}"


def _bit_sum(x: Array) -> UInt32[Array, ""]:
    """A wrapping uint32 sum of ``x``'s bits: changes with any damage to its stored bytes."""
    if x.dtype == jnp.bool_:
        return jnp.sum(x, dtype=jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)  # 8 bytes: two uint32 words
    return jnp.sum(jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32), dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnames="to_device")
def audit(tree: Any, to_device: bool = False) -> tuple[Bool[Array, " N"], UInt32[Array, " N"]]:
    """Per array leaf of ``tree`` (in ``named_leaves`` order): whether it is finite, and its
    bit sum, in one pass: cheap enough to run before every save."""
    if to_device:  # pinned_host trees: computing needs them on the device
        tree = tree_placement(tree, "device")
    leaves = list(named_leaves(tree).values())
    finite = [jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True) for x in leaves]
    return jnp.stack(finite), jnp.stack([_bit_sum(x) for x in leaves])


def first_non_finite(tree: Any, finite: Any) -> str | None:
    """The first leaf that ``audit`` found non-finite, described (None: all finite)."""
    bad = [name for name, ok in zip(named_leaves(tree), np.asarray(finite)) if not ok]
    return _describe(_params_first(bad)[0]) if bad else None


def _short(e: BaseException) -> str:
    """An exception in one short line (orbax's and TensorStore's messages run to pages); the
    innermost cause is the one that names the array and the file."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    line = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return line if len(line) <= 240 else line[:237] + "..."
