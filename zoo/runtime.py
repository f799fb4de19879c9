"""Process-wide runtime settings: the host allocator (XLA:CPU), the XLA compile options of the
train step per backend (:func:`step_xla_options`), and XLA's pinned host memory pool on GPU
(:func:`size_host_pool`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import xla_bridge

from zoo.errors import ConfigError

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


# -- XLA compile options of the train step ------------------------------------------------------


@dataclass(frozen=True)
class XlaOption:
    """One XLA option the train step is compiled with: its value, why it is set, where it is published;
    ``older``: the ``(name, value)`` spellings an older XLA takes in its place, tried in order where the
    installed one does not know ``name``."""

    name: str
    value: bool | int | str
    why: str
    source: str
    older: tuple[tuple[str, bool | int | str], ...] = ()


_TOOLBOX = "NVIDIA JAX-Toolbox, rosetta/docs/GPU_performance.md"
_MAXTEXT_GPU = "MaxText, MaxText/configs/a3/llama_2_7b/1vm.sh (XLA_FLAGS)"
_MAXTEXT_TPU = "MaxText, benchmarks/xla_flags_library.py (HOST_OFFLOAD_FLAGS)"
_XLA = "XLA, xla/debug_options_flags.cc"
_PIPELINE_ON = "COLLECTIVE_PIPELINING_MODE_ON"  # XLA's DebugOptions.CollectivePipeliningMode

# The GPU set: the scheduler and host offloading that let activation copies overlap compute (the
# placement maps' pinned_host names), then the collective settings of the published JAX GPU recipes.
GPU_OPTIONS: tuple[XlaOption, ...] = (
    XlaOption("xla_gpu_enable_latency_hiding_scheduler", True,
              "start async copies and collectives early so they run under compute, not in front of their user",
              f"{_TOOLBOX}; {_MAXTEXT_GPU}"),
    XlaOption("xla_gpu_enable_host_memory_offloading", True,
              "XLA's memory passes count pinned-host buffers as host memory (not against the HBM limit)",
              f"{_XLA}; zoo benchmarks/placement.py"),
    XlaOption("xla_gpu_enable_pipelined_host_offloading", True,
              "a scan's offload copies move one iteration early or late, so a layer's copy overlaps the next "
              "layer's compute (XLA's default: off)", _XLA),
    XlaOption("xla_gpu_enable_highest_priority_async_stream", True,
              "async collectives and copies on the highest-priority stream, not starved by compute kernels",
              f"{_TOOLBOX}; {_MAXTEXT_GPU}"),
    XlaOption("xla_gpu_all_reduce_combine_threshold_bytes", 134217728,
              "all-reduces combined up to 128 MiB: fewer, larger NCCL calls", _MAXTEXT_GPU),
    XlaOption("xla_gpu_all_gather_combine_threshold_bytes", 134217728,
              "all-gathers combined up to 128 MiB (FSDP's per-layer weight gathers)", _MAXTEXT_GPU),
    XlaOption("xla_gpu_reduce_scatter_combine_threshold_bytes", 67108864,
              "reduce-scatters combined up to 64 MiB (FSDP's per-layer gradient scatters)", _MAXTEXT_GPU),
    # jaxlib 0.12.1's XLA spells the pipelining switches as modes (xla_gpu_pipeline_*: DEFAULT, OFF, ON,
    # EXPLICIT; ON is the old flags' true); older ones take the booleans.
    XlaOption("xla_gpu_pipeline_all_gather", _PIPELINE_ON,
              "FSDP: the next layer's weights are gathered while this layer computes", f"{_TOOLBOX}; {_MAXTEXT_GPU}",
              (("xla_gpu_enable_pipelined_all_gather", True),)),
    XlaOption("xla_gpu_pipeline_reduce_scatter", _PIPELINE_ON,
              "FSDP: a layer's gradient scatter finishes under the previous layer's backward",
              f"{_TOOLBOX}; {_MAXTEXT_GPU}", (("xla_gpu_enable_pipelined_reduce_scatter", True),)),
    XlaOption("xla_gpu_pipeline_all_reduce", _PIPELINE_ON,
              "data parallelism: gradient all-reduces inside the layer scan overlap the next iteration", _MAXTEXT_GPU,
              (("xla_gpu_enable_pipelined_all_reduce", True),)),
    XlaOption("xla_gpu_enable_while_loop_double_buffering", True,
              "the layer scan unrolled by two, so one iteration's pipelined transfers overlap the other's compute",
              f"{_TOOLBOX}; {_MAXTEXT_GPU}"),
)  # fmt: skip

# The TPU set: MaxText's published host-offload scheduler settings (libtpu options).
TPU_OPTIONS: tuple[XlaOption, ...] = (
    XlaOption("xla_tpu_enable_all_experimental_scheduler_features", True,
              "the scheduler's newer overlap features, host transfers among them", _MAXTEXT_TPU),
    XlaOption("xla_tpu_enable_scheduler_memory_pressure_tracking", True,
              "the scheduler tracks live memory, so early host fetches do not overflow HBM", _MAXTEXT_TPU),
    XlaOption("xla_tpu_host_transfer_overlap_limit", 24, "up to 24 host transfers in flight under compute", _MAXTEXT_TPU),
    XlaOption("xla_tpu_aggressive_opt_barrier_removal", "ENABLED",
              "optimization barriers (remat's) removed where they would pin a transfer in place", _MAXTEXT_TPU),
    XlaOption("xla_lhs_prioritize_async_depth_over_stall", "ENABLED",
              "the scheduler prefers deeper async overlap (transfers started earlier)", _MAXTEXT_TPU),
    XlaOption("xla_tpu_enable_ag_backward_pipelining", True,
              "FSDP: the backward pass's all-gathers pipelined across layers", _MAXTEXT_TPU),
    XlaOption("xla_should_allow_loop_variant_parameter_in_chain", "ENABLED",
              "transfers of per-layer (loop-variant) buffers may be chained across scan iterations", _MAXTEXT_TPU),
    XlaOption("xla_should_add_loop_invariant_op_in_chain", "ENABLED",
              "loop-invariant ops may join those chains", _MAXTEXT_TPU),
    XlaOption("xla_max_concurrent_host_send_recv", 100, "up to 100 host sends/receives at once", _MAXTEXT_TPU),
    XlaOption("xla_tpu_scheduler_percent_shared_memory_limit", 100,
              "the scheduler may use all of the shared memory budget for overlap", _MAXTEXT_TPU),
    XlaOption("xla_latency_hiding_scheduler_rerun", 2, "the latency-hiding scheduler reruns twice to refine",
              _MAXTEXT_TPU),
)  # fmt: skip

XLA_OPTIONS: dict[str, tuple[XlaOption, ...]] = {"gpu": GPU_OPTIONS, "tpu": TPU_OPTIONS, "cpu": ()}


class XlaOptionWarning(UserWarning):
    """Options the installed XLA does not know, dropped from a step's compile options."""


def backend_platform(platform: str) -> str:
    """``gpu``, ``tpu`` or ``cpu`` for a JAX platform or lowering-platform name (``cuda``, ``rocm`` ...)."""
    p = platform.lower()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def parse_xla_option(text: str) -> tuple[str, bool | int | float | str]:
    """``KEY=VALUE`` (a leading ``--`` allowed) as ``(key, value)``: ``true``/``false`` a bool, digits an int,
    a decimal a float, anything else a string. A ``ValueError`` names the text without an ``=``."""
    key, eq, raw = text.strip().removeprefix("--").partition("=")
    key, raw = key.strip(), raw.strip()
    if not eq or not key or not raw:
        raise ValueError(f"expected KEY=VALUE (e.g. xla_gpu_enable_latency_hiding_scheduler=true), got {text!r}")
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


@functools.cache
def _known(platform: str, items: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, str], ...]:
    """``(name, XLA's reason)`` of each option that a trivial program on ``platform``'s backend (the default
    backend where that one is absent: the debug options are one proto for every backend) fails to compile with."""
    try:
        device = jax.devices(platform)[0]
    except RuntimeError:
        device = jax.devices()[0]
    x = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=jax.sharding.make_single_device_sharding(device))
    lowered = jax.jit(lambda v: v + 1).lower(x)
    try:
        lowered.compile(dict(items))
        return ()
    except Exception:  # noqa: BLE001  (XLA: "No such compile option", or a value it cannot parse)
        pass
    bad = []
    for name, value in items:
        try:
            lowered.compile({name: value})
        except Exception as e:  # noqa: BLE001
            bad.append((name, str(e).splitlines()[0][:160]))
    return tuple(bad)


def step_xla_options(platform: str, overrides: Mapping[str, Any] | None = None, *, defaults: bool = True) -> dict[str, Any]:
    """The compile options of a train step on ``platform``: its set (:data:`XLA_OPTIONS`, unless
    ``defaults=False``) with ``overrides`` on top. Options the installed XLA does not know are dropped
    with one :class:`XlaOptionWarning` naming them, never an error at the step's compile."""
    backend = backend_platform(platform)
    chosen = XLA_OPTIONS.get(backend, ()) if defaults else ()
    given = dict(overrides or {})
    # A default given under an older spelling is the user's: the default's own spelling goes.
    options = {o.name: o.value for o in chosen if not any(n in given for n, _ in o.older)}
    options.update(given)
    if not options:
        return {}
    bad = dict(_known(backend, tuple(sorted(options.items()))))
    for o in chosen:  # a default this XLA knows under an older spelling only: that spelling
        if o.name in bad and o.name not in given:
            alt = next(((n, v) for n, v in o.older if not _known(backend, ((n, v),))), None)
            if alt is not None:
                del bad[o.name], options[o.name]
                options[alt[0]] = alt[1]
    if bad:
        unknown = [n for n, why in bad.items() if "No such compile option" in why]
        refused = [f"{n}={options[n]!r} ({why})" for n, why in bad.items() if n not in unknown]
        said = ([f"unknown to it: {', '.join(unknown)}"] if unknown else []) + ([f"refused: {'; '.join(refused)}"] if refused else [])
        warnings.warn(f"the installed XLA (jaxlib) does not take {len(bad)} {backend_platform(platform)} option(s); the "
                      f"step compiles without them. {'. '.join(said)}", XlaOptionWarning, stacklevel=2)  # fmt: skip
    return {k: v for k, v in options.items() if k not in bad}


def describe_xla_options(platform: str, options: Mapping[str, Any]) -> str:
    """The options as a run prints them: one per line, with why and the source for the defaults."""
    known = {n: replace(o, value=v) for o in XLA_OPTIONS.get(backend_platform(platform), ())
             for n, v in ((o.name, o.value), *o.older)}  # fmt: skip
    if not options:
        return f"XLA options of the step ({backend_platform(platform)}): none (XLA's defaults)"
    lines = [f"XLA options of the step ({backend_platform(platform)}):"]
    for name, value in options.items():
        o = known.get(name)
        given = o is None or o.value != value
        lines.append(f"  {name}={value}" + ("  (given)" if given else f"  ({o.why}; {o.source})"))
    return "\n".join(lines)


# -- XLA's pinned host memory pool (GPU) --------------------------------------------------------

HOST_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
# PJRT's GPU client caps its pinned host allocator at this many GiB unless the variable says
# otherwise; the pool grows on demand up to the cap (XLA, xla/pjrt/gpu/se_gpu_pjrt_client.cc).
HOST_POOL_DEFAULT_GIB = 64
_GIB = 2**30


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (``None`` where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def size_host_pool(need: int | float, *, what: str = "the run") -> int:  # noqa: PYI041  (beartype: no int as float)
    """Set :data:`HOST_POOL_ENV` so XLA's pinned host pool holds ``need`` bytes (this process's devices
    together) with a tenth and 1 GiB to spare; returns the pool's cap in GiB. Call before the backend
    starts. A :class:`~zoo.errors.ConfigError` when ``need`` exceeds the machine's memory, when the
    variable is set lower by the user, or when the backend already started with too small a pool."""
    gib = math.ceil(need * 1.1 / _GIB) + 1
    total = physical_memory()
    if total is not None and need > total:
        raise ConfigError(f"{what} needs {need / _GIB:.1f} GiB of pinned host memory on this process, more than the "
                          f"machine's {total / _GIB:.1f} GiB: place less in pinned_host (--placement, --param-memory, "
                          "--opt-memory) or use more devices")  # fmt: skip
    given = os.environ.get(HOST_POOL_ENV)
    current = int(given) if given and given.strip().isdigit() else HOST_POOL_DEFAULT_GIB
    if current * _GIB >= need:
        return current
    started = getattr(xla_bridge, "backends_are_initialized", lambda: bool(getattr(xla_bridge, "_backends", None)))
    if given or started():
        why = f"{HOST_POOL_ENV}={given}" if given else f"the backend already started with {HOST_POOL_ENV}'s default"
        raise ConfigError(f"{what} needs {need / _GIB:.1f} GiB of pinned host memory, but {why} caps XLA's pool at "
                          f"{current} GiB: set {HOST_POOL_ENV}={gib} before JAX starts")  # fmt: skip
    os.environ[HOST_POOL_ENV] = str(gib)
    return gib
