"""Test-wide settings: 8 simulated CPU devices, strict dtype promotion, fixture paths.

Shape annotations are checked at run time by the jaxtyping import hook with beartype
(``--jaxtyping-packages=zoo,beartype.beartype`` in pyproject.toml).
"""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite is dominated by XLA's CPU compile time, not run time: LLVM's -O0 and the classic
# (non-MLIR) fusion emitters compile ~4x faster on the 2-core CI machine. Numerics stay IEEE
# float32 either way (XLA never enables fast-math reassociation); the parity tests hold.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")

# Identical programs compiled by different tests (and the recipe subprocesses) compile once.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "zoo-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz") as r:
        return dict(r)
