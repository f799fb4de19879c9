"""Training: data determinism, optimizer masks, accumulation, resume (also after SIGKILL), NaN stop."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import zoo
from zoo import train as ztrain
from zoo.data import TokenData, stdlib_corpus, text_files
from zoo.deepseek_v3 import DeepseekV3Training
from zoo.deepseek_v3 import preset as ds_preset
from zoo.llama import preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus() -> TokenData:
    return stdlib_corpus(max_bytes=2 * 2**20)


def _cfg(**kw) -> ztrain.TrainConfig:
    base = dict(steps=6, batch_size=4, seq_len=32, warmup=1, lr=3e-3, log_every=1, eval_every=3, eval_batches=2,
                checkpoint_every=3)  # fmt: skip
    return ztrain.TrainConfig(**{**base, **kw})


def test_batches_depend_only_on_seed_and_step(corpus):
    a = corpus.batch(0, 7, 4, 32)
    assert np.array_equal(a, corpus.batch(0, 7, 4, 32))
    assert not np.array_equal(a, corpus.batch(0, 8, 4, 32))
    assert not np.array_equal(a, corpus.batch(1, 7, 4, 32))
    assert a.dtype == np.int32 and a.max() < 256


def test_stdlib_split_is_deterministic_and_disjoint(corpus):
    again = stdlib_corpus(max_bytes=2 * 2**20)
    assert np.array_equal(corpus.valid, again.valid)
    assert len(corpus.valid) > 1000
    window = bytes(corpus.valid[1000:1200])
    assert window not in bytes(corpus.train)  # validation files are held out whole


def test_text_file_data(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    data = text_files([tmp_path / "a.txt"])
    assert len(data.train) + len(data.valid) == 1200
    with pytest.raises(zoo.ConfigError, match="nope.txt is not a file"):
        text_files([tmp_path / "nope.txt"])


def test_no_weight_decay_on_norms_and_no_update_for_router_bias():
    model = zoo.DeepseekV3(ds_preset("tiny"), key=jr.key(0))
    cfg = _cfg(lr=1e-2, weight_decay=0.5)
    tx = ztrain.optimizer(cfg, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    zeros = jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def second_update(params):  # the first step's learning rate is 0 (warm-up starts there)
        with jax.numpy_dtype_promotion("standard"):
            _, state = tx.update(zeros, tx.init(params), params)
            return tx.update(zeros, state, params)[0]

    updates = second_update(params)
    # With zero gradients only weight decay moves parameters: matrices, not norms, not the bias.
    assert float(jnp.abs(updates.moe_layers.attn.wkv_b).max()) > 0
    assert float(jnp.abs(updates.moe_layers.attn_norm).max()) == 0
    assert float(jnp.abs(updates.final_norm).max()) == 0
    assert float(jnp.abs(updates.moe_layers.moe.router_bias).max()) == 0


def test_gradient_accumulation_equals_the_big_batch(corpus):
    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    big = jnp.asarray(corpus.batch(0, 0, 8, 32))
    outs = []
    for accum in (1, 2):
        cfg = _cfg(batch_size=8 // accum, grad_accum=accum)
        tx = ztrain.optimizer(cfg, model)
        params = jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array))  # the step donates them
        step = ztrain.make_train_step(model, cfg, tx)
        new, _, metrics = step(params, tx.init(params), big.reshape(accum, 8 // accum, 32), jnp.int32(0))
        outs.append((metrics, new))
    (m1, p1), (m2, p2) = outs
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_deepseek_step_updates_router_bias_from_load(corpus):
    model = zoo.DeepseekV3(ds_preset("tiny"), key=jr.key(0))
    cfg = _cfg(model_options=DeepseekV3Training(router_bias_rate=0.01))
    tx = ztrain.optimizer(cfg, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    step = ztrain.make_train_step(model, cfg, tx)
    new, _, metrics = step(params, tx.init(params), jnp.asarray(corpus.batch(0, 0, 4, 32))[None], jnp.int32(0))
    load = np.asarray(metrics["expert_load"])
    expected = 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(new.moe_layers.moe.router_bias, expected, atol=1e-7)


def test_loss_falls(corpus, tmp_path):
    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    _, history = ztrain.train(model, corpus, _cfg(steps=30, lr=1e-2, warmup=3, eval_every=30, checkpoint_every=100),
                              run_dir=tmp_path)  # fmt: skip
    assert history[0]["step"] == 0 and history[0]["val_loss"] > 5.0  # a fresh model: about ln 256
    assert history[-1]["val_loss"] < 4.0 < history[1]["loss"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 30 and {"loss", "val_loss", "tokens_per_s", "grad_norm", "lr"} <= set(lines[-1])
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_equals_uninterrupted(corpus, tmp_path):
    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    _, full = ztrain.train(model, corpus, _cfg(), run_dir=tmp_path / "full")
    full = [r for r in full if "loss" in r]
    ztrain.train(model, corpus, _cfg(), run_dir=tmp_path / "cut", stop_after=3)
    _, rest = ztrain.train(model, corpus, _cfg(), run_dir=tmp_path / "cut", resume=True)
    assert [r["step"] for r in rest] == [4, 5, 6]
    np.testing.assert_array_equal([r["loss"] for r in full[3:]], [r["loss"] for r in rest])


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    import orbax.checkpoint as ocp

    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    ztrain.train(model, corpus, _cfg(steps=12), run_dir=tmp_path, stop_after=3)
    poisoned = eqx.tree_at(lambda m: m.final_norm, model, jnp.full_like(model.final_norm, jnp.nan))
    with pytest.raises(ztrain.NonFiniteLoss, match="loss is nan"):
        ztrain.train(poisoned, corpus, _cfg(steps=12), run_dir=tmp_path / "other")
    # A resumed run whose step turns NaN does not write: the step-3 checkpoint stays the latest.
    manager = ocp.CheckpointManager((tmp_path / "checkpoints").absolute())
    assert manager.latest_step() == 3


def _recipe(run_dir, *extra):
    args = [sys.executable, str(ROOT / "recipes" / "train.py"), "--preset", "tiny", "--steps", "8", "--warmup", "2",
            "--batch-size", "4", "--seq-len", "32", "--log-every", "1", "--eval-every", "100", "--checkpoint-every", "2",
            "--peak-tflops", "1", "--run-dir", str(run_dir), *extra]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    return args, env


def test_sigkill_mid_training_then_resume_matches(tmp_path):
    args, env = _recipe(tmp_path / "full")
    subprocess.run(args, env=env, check=True, capture_output=True, timeout=600)
    full = [r["loss"] for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines() if "loss" in (r := json.loads(x))]

    args, env = _recipe(tmp_path / "killed")
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # wait for a checkpoint to exist and a few more steps, then kill -9
        if line.startswith("step 5/"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    args, env = _recipe(tmp_path / "killed", "--resume")
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True, timeout=600).stdout
    assert "resumed from" in out
    records = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in records if "loss" in r}  # later lines (the resumed run) win
    assert sorted(resumed) == list(range(1, 9))
    np.testing.assert_array_equal([resumed[s] for s in range(1, 9)], full)


def test_recipe_rejects_bad_flags():
    args, env = _recipe("/tmp/unused")
    out = subprocess.run([*args, "--warmup", "50"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--warmup (50) must be smaller than --steps (8)" in out.stderr


@pytest.mark.parametrize("model, flag", [("qwen3_moe", "--aux-loss-coef"), ("deepseek_v3", "--router-bias-rate")])
def test_recipe_trains_every_family_with_its_own_options(tmp_path, model, flag):
    """``--model`` takes every registered model type; a family's training options are flags
    (generated from its options dataclass) that reach its loss, and its metrics are logged."""
    args, env = _recipe(tmp_path, "--model", model, "--preset", "tiny", "--steps", "3", "--warmup", "1",
                        "--eval-every", "3", "--log-every", "1", flag, "0.01")  # fmt: skip
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == 3 and np.isfinite(last["val_loss"]) and "balance_loss" in last
    assert len(last["expert_load"]) == 2  # two MoE layers in both tiny presets, counts per expert
    help_text = subprocess.run([*args[:2], "--help"], env=env, capture_output=True, text=True, timeout=120).stdout
    assert all(f in help_text for f in ("--aux-loss-coef", "--mtp-weight", "--router-bias-rate", "qwen3_moe"))
