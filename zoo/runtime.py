"""Process-wide settings for running XLA on a host CPU."""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_INT_MAX = 2**31 - 1

# The same settings as environment variables, for a process started by someone else.
RETAIN_HOST_MEMORY_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(_INT_MAX)}


def retain_host_memory() -> bool:
    """Keep the memory this process frees for its next allocation instead of handing it back
    to the kernel (glibc only; returns whether the settings took).

    XLA:CPU allocates a step's temporaries (450 MB for the Llama bench train step) and frees
    them when the step ends. glibc returns blocks that large to the kernel at once (``mmap``
    and ``munmap``, or a per-thread arena trimmed on free), so every step page-faults all of
    them back in: measured 115,000 minor faults and 0.3 s of system time a step, about 12% of
    the step on 2 cores. One arena, no ``mmap`` and no trimming make the next step reuse the
    same pages: measured, 5 steps of 6 then fault nothing (the heap still takes fresh pages now
    and then after fragmentation). The price is that the process keeps its peak heap until it
    exits, which is what a training process wants anyway.

    Threads that already have their own arena keep it, so call this before the first JAX
    computation (the recipes and benchmarks do). For a process you do not start from Python,
    set :data:`RETAIN_HOST_MEMORY_ENV` in its environment instead.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt): nothing to do
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX))
    return all(mallopt(param, value) == 1 for param, value in settings)


def resident_memory() -> tuple[int, int] | None:
    """``(now, peak)`` resident bytes of this process (``VmRSS``, ``VmHWM`` of Linux's
    /proc/self/status); ``None`` where there is no such file."""
    try:
        text = open("/proc/self/status").read()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (KeyError, ValueError):
        return None


def reset_resident_peak() -> int | None:
    """Set this process's resident peak (``VmHWM``) to its current resident memory (Linux's
    ``/proc/self/clear_refs`` 5), so a later :func:`resident_memory` peak is that of what ran
    since; returns the current resident bytes (``None`` where Linux's files are missing)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    now = resident_memory()
    return None if now is None else now[0]
