"""Test-wide settings: 8 simulated CPU devices, strict dtype promotion, fixture paths.

Shape annotations are checked at run time by the jaxtyping import hook with beartype
(``--jaxtyping-packages=zoo,beartype.beartype`` in pyproject.toml).
"""

import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _xla_accepts(flags: str) -> bool:
    """Whether the installed XLA runs with ``flags`` in XLA_FLAGS. Asked of a child process: XLA
    aborts the whole process, printing nothing, on a flag it does not know (jax 0.12's XLA no
    longer has --xla_cpu_use_fusion_emitters)."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    probe = "import jax.numpy as jnp; jnp.zeros(2).block_until_ready()"
    try:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# The suite is dominated by XLA's CPU compile time, not run time: LLVM's -O0 and the classic
# (non-MLIR) fusion emitters compile ~4x faster on the 2-core CI machine. Numerics stay IEEE
# float32 either way (XLA never enables fast-math reassociation); the parity tests hold. Each
# flag is set only where the installed XLA has it.
if "XLA_FLAGS" not in os.environ:
    FAST_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    if not _xla_accepts(FAST_FLAGS):
        FAST_FLAGS = "--xla_backend_optimization_level=0" if _xla_accepts("--xla_backend_optimization_level=0") else ""
    os.environ["XLA_FLAGS"] = FAST_FLAGS

# Identical programs compiled by the recipe subprocesses compile once. A fresh cache per run, as
# on CI's clean machine: programs loaded from an earlier run's entries crashed XLA:CPU (jaxlib
# 0.10) late in long local runs (docs/training.md, host memory). This process itself does not use
# it (below): an 8-device program it loaded from its own cache aborted XLA:CPU ("Fatal Python
# error: Aborted", nothing else printed) in about 1 of 15 runs of a test that trains the same
# model four times (CI, 2026-12-04: tests/test_vocab_parallel.py; 2 of ~30 runs here with the
# cache, 0 of 17 without).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="zoo-test-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# `datasets.load_dataset` (hub-layout folders in test_data.py) writes Arrow files into its cache.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="zoo-test-hf-datasets-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite reaches the network

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_enable_compilation_cache", False)  # this process: see above

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_collection_modifyitems(session, config, items):
    """Tests marked ``host_memory`` run last. They run programs that use pinned host memory in
    this process, after which jaxlib 0.10's XLA:CPU may abort the next multi-device program
    (printing nothing but "Fatal Python error: Aborted"; it happened to CI once in ~10 runs).
    Multi-device programs with host memory run in a fresh process of their own
    (``helpers.run_in_fresh_process``); none runs in this one after these. Under pytest-xdist
    each worker is handed tests in this order, so the marked ones are last in every worker."""
    items.sort(key=lambda item: item.get_closest_marker("host_memory") is not None)  # stable


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drop every compiled program when a test file ends. XLA:CPU maps three memory regions
    per compiled kernel and frees them only with the executable, which JAX's caches keep alive;
    one process running the whole suite reached Linux's default limit of 65,530 mappings
    (``vm.max_map_count``) about 470 tests in, where the next mmap failed and XLA aborted
    ("Fatal Python error: Aborted", nothing else printed; CI and local runs alike)."""
    yield
    before = _memory_maps()
    jax.clear_caches()
    gc.collect()
    if os.environ.get("ZOO_TEST_REPORT_MAPS"):
        print(f"\n[memory maps: {before} -> {_memory_maps()}]")


# Well under Linux's default vm.max_map_count (65,530): a worker of pytest-xdist may run many
# tests of several files between two file ends, and one file alone reaches ~15,000 mappings.
_MAPS_LIMIT = 40_000


@pytest.fixture(autouse=True)
def _free_compiled_programs_when_many():
    """As :func:`_free_compiled_programs`, after any test that leaves more than ``_MAPS_LIMIT``
    memory mappings (counting them reads one small file)."""
    yield
    if _memory_maps() > _MAPS_LIMIT:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz") as r:
        return dict(r)
