"""zoo.runtime.retain_host_memory: a step's temporaries stop page-faulting after the first step."""

import subprocess
import sys
import textwrap

import pytest

# A jitted function whose temporaries (~64 MB) are allocated and freed on every call; prints the
# minor page faults of the last of three calls.
PROGRAM = textwrap.dedent(
    """
    import resource, sys
    if sys.argv[1] == "retain":
        from zoo.runtime import retain_host_memory
        assert retain_host_memory()
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x: (jnp.sin(x) @ jnp.cos(x)).sum() + (jnp.exp(x) * 2).sum())
    x = jnp.ones((2048, 2048))
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults)
    """
)


def _faults(mode: str) -> int:
    env_python = [sys.executable, "-c", PROGRAM, mode]
    out = subprocess.run(env_python, capture_output=True, text=True, timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt settings are glibc's")
def test_retained_memory_is_not_faulted_back_in():
    plain, retained = _faults("plain"), _faults("retain")
    # 48 MB of temporaries is ~12,000 pages of 4 KiB, faulted in again on every call by default.
    assert plain > 5000, plain
    assert retained < 500, retained

