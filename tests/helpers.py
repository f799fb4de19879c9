"""Shared checks: parity of a loaded model against a ``transformers`` reference."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import zoo


def global_norm(tree) -> float:
    leaves = [x for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]
    return float(jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)))


def check_parity(path: Path, *, atol: float = 1e-5, rtol: float = 1e-5, **load) -> None:
    """Logits, every hidden state, loss and gradient norm against ``reference.npz``."""
    ref = dict(np.load(path / "reference.npz"))
    model = zoo.from_pretrained(path, **load)
    ids = jnp.asarray(ref["input_ids"])
    out = eqx.filter_jit(lambda m, x: m.forward(x, return_hidden=True))(model, ids)
    logits, hidden = out[0], out[1]
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=atol, rtol=0)
    assert hidden.shape == ref["hidden_states"].shape
    for i, (h, r) in enumerate(zip(np.asarray(hidden), ref["hidden_states"])):
        np.testing.assert_allclose(h, r, atol=atol, rtol=0, err_msg=f"hidden state {i}")
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))(model, ids)
    np.testing.assert_allclose(float(loss), float(ref["loss"]), rtol=rtol)
    np.testing.assert_allclose(global_norm(grads), float(ref["grad_norm"]), rtol=rtol)


def supported_compile_options(options: dict) -> dict:
    """The subset of XLA compile ``options`` the installed XLA knows (jax 0.12's refuses
    ``xla_cpu_use_fusion_emitters``), each tried on a trivial program."""
    f = jax.jit(lambda x: x + 1)
    lowered = f.lower(jnp.zeros(2))
    known = {}
    for name, value in options.items():
        try:
            lowered.compile({name: value})
        except Exception:  # noqa: BLE001  (XLA's INVALID_ARGUMENT: no such compile option)
            continue
        known[name] = value
    return known


def run_in_fresh_process(script: str, timeout: int = 600, *, xla_defaults: bool = False) -> str:
    """Run ``script`` in a new Python (8 CPU devices, strict promotion, the tests folder on the
    path, no persistent compilation cache) and return its stdout; its stderr on failure.
    ``xla_defaults``: without the suite's compile-time XLA_FLAGS (conftest.py), as users compile.

    For multi-device programs that touch pinned host memory: jaxlib 0.10's XLA:CPU aborts or
    deadlocks a multi-device program in a process where a host-memory program ran before, and
    one loaded from the persistent compilation cache (see conftest.py's ``host_memory`` marker).
    """
    import os
    import subprocess
    import sys

    tests = Path(__file__).parent
    prelude = (
        "import jax\n"
        "jax.config.update('jax_num_cpu_devices', 8)\n"
        "jax.config.update('jax_numpy_dtype_promotion', 'strict')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)]),
           "JAX_ENABLE_COMPILATION_CACHE": "false"}  # fmt: skip
    if xla_defaults:
        env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", prelude + script], capture_output=True, text=True, env=env,
                         timeout=timeout, check=False)  # fmt: skip
    assert out.returncode == 0, f"exit code {out.returncode}:\n{out.stderr[-3000:]}"
    return out.stdout


def free_port() -> int:
    """A TCP port free on the loopback address now (a coordinator's, for multi-process tests)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_on_a_mesh_like_one_device(model, mesh, tmp_path: Path, **settings):
    """``zoo.train`` of ``model`` on ``mesh`` and on one device (4 steps of the stdlib corpus,
    checkpoints at 2 and 4): asserts the losses agree (rtol 1e-5, the parity figure) and a run
    stopped after step 2 resumes bit for bit; returns ``load_run`` of the resumed run."""
    from zoo import train as ztrain
    from zoo.data import stdlib_corpus

    corpus = stdlib_corpus(max_bytes=2**20)
    cfg = ztrain.TrainConfig(steps=4, batch_size=8, seq_len=32, warmup=1, lr=3e-3, log_every=1, eval_every=4,
                             eval_batches=1, checkpoint_every=2, **settings)  # fmt: skip
    _, one = ztrain.train(model, corpus, cfg, run_dir=tmp_path / "one")
    _, full = ztrain.train(model, corpus, cfg, run_dir=tmp_path / "full", mesh=mesh)
    ztrain.train(model, corpus, cfg, run_dir=tmp_path / "cut", mesh=mesh, stop_after=2)
    _, rest = ztrain.train(model, corpus, cfg, run_dir=tmp_path / "cut", mesh=mesh, resume=True)
    losses = lambda history: [r["loss"] for r in history if "loss" in r]  # noqa: E731
    np.testing.assert_allclose(losses(full), losses(one), rtol=1e-5)
    np.testing.assert_array_equal(losses(full)[2:], losses(rest))
    return ztrain.load_run(tmp_path / "cut")


def load_recipe(name: str, tag: str = "") -> object:
    """``recipes/<name>.py`` imported as a module (``<name>_recipe<tag>``: a test file's own copy)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_recipe{tag}", Path(__file__).parents[1] / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
