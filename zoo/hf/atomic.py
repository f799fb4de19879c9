"""A directory that appears complete or not at all: written under a temporary name beside its
path, then swapped into place in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``) or, where
the system has no such swap, by two renames whose gap :func:`recover` closes. What writers killed
mid-way left beside the path is removed by the next one (:func:`temp_dir`). Generic: which of
the directory's files a write replaces is the caller's to say (:func:`swap_in`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from zoo.errors import CheckpointError

log = logging.getLogger("zoo")

# What temp_dir's tempfile.mkdtemp names look like after ".NAME." (older saves had no pid).
_TMP_NAME = re.compile(r"(?:(\d+)\.)?[a-z0-9_]{8}\.tmp")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def umask() -> int:
    """The process's umask, read without changing it where Linux allows (os.umask alone must set it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    """``text`` in file ``path``, on disk before this returns."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_or_copy(src, dst) -> None:
    """Hard-link ``src`` to ``dst`` (instant, no extra space); copy where the filesystem refuses."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)  # the original is deleted after the swap
        finally:
            os.close(fd)


def _carry_over(old: Path, new: Path, replaced: Callable[[str], bool]) -> None:
    """Put everything of ``old`` that is not the model's own (the names ``replaced`` refuses: a
    checkpoint's tokenizer, README, subfolders) into ``new``."""
    for p in old.iterdir():
        if replaced(p.name):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, new / p.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(p, new / p.name)


@functools.cache
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where unsupported."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):  # old kernel, or the filesystem lacks it
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def recover(path: Path) -> None:
    """Put back the checkpoint a save killed between its two renames left only as ``.NAME.old``."""
    old = path.with_name(f".{path.name}.old")
    if not os.path.lexists(path) and old.is_dir() and not old.is_symlink():
        try:
            os.rename(old, path)
        except OSError as e:
            raise CheckpointError(
                f"{path}: missing; an interrupted save left it at {old}, which cannot be moved back ({e.strerror})"
            ) from None
        log.warning("%s: restored the checkpoint from %s, where an interrupted save had left it", path, old)


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # not our own directory, so an earlier process's with our pid (containers reuse them)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _remove_stale(path: Path, ours: Path, marker: str) -> None:
    """Remove what killed saves to ``path`` left beside it: temporary directories older than ours whose
    process is gone, and a ``.NAME.old`` previous checkpoint (stale, since ``path`` exists, with its
    ``marker`` file)."""
    since = ours.stat().st_mtime_ns
    prefix = f".{path.name}."
    for p in path.parent.iterdir():
        if p == ours or not p.name.startswith(prefix) or p.is_symlink() or not p.is_dir():
            continue
        rest = p.name[len(prefix) :]
        if rest == "old" and (path / marker).exists():  # path is the complete checkpoint that replaced it
            why = "the previous checkpoint left by an interrupted save"
        elif (m := _TMP_NAME.fullmatch(rest)) and p.stat().st_mtime_ns < since and not (m[1] and _alive(int(m[1]))):
            why = "a temporary directory left by an interrupted save"
        else:
            continue
        try:
            shutil.rmtree(p)
        except OSError as e:
            log.warning("%s: could not remove %s, %s (%s)", path, p, why, e)
        else:
            log.warning("%s: removed %s, %s", path, p, why)


def temp_dir(path: Path, marker: str) -> Path:
    """A new temporary directory beside ``path`` to write the new directory into, with the
    umask's permissions; what killed writes to ``path`` left beside it is removed first
    (``marker``: a file only a complete directory has, e.g. ``config.json``)."""
    # The pid in the name tells a later save whether the process writing it is still alive.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp's 0700 would outlive the rename
        _remove_stale(path, tmp, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def swap_in(tmp: Path, path: Path, replaced: Callable[[str], bool]) -> Path | None:
    """Put the written directory ``tmp`` at ``path``, carrying over first what of the directory
    there the write does not replace (the names ``replaced`` refuses); returns the previous
    directory's new place, to remove, or ``None`` where there was none."""
    if path.exists():
        _carry_over(path, tmp, replaced)
    _fsync_dir(tmp)
    if not path.exists():
        os.rename(tmp, path)
        retired = None
    elif _exchange(tmp, path):
        retired = tmp  # now the previous checkpoint
    else:
        # No atomic exchange here: two renames, and a load finding only .NAME.old restores it.
        retired = path.with_name(f".{path.name}.old")
        os.rename(path, retired)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(retired, path)
            raise
    _fsync_dir(path.parent)
    return retired
