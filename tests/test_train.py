"""Training: data determinism, optimizer masks, accumulation, resume (also after SIGKILL), NaN stop,
run-dir guards, damaged checkpoints, flag checks."""

import dataclasses
import fcntl
import json
import os
import re
import shutil
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
from zoo.plan import auto

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
    again = subprocess.run(args, check=False, env=env, capture_output=True, text=True, timeout=600)
    finished = f"run in {tmp_path / 'killed'} already finished at step 8; nothing to do"
    assert again.returncode == 0 and finished in again.stdout


def _small_context_checkpoint(tmp_path) -> Path:
    """The Llama fixture with max_position_embeddings 16 (beyond it: a --seq-len that is cheap to refuse)."""
    path = shutil.copytree(ROOT / "tests" / "fixtures" / "llama3_1-tiny", tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    return path


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--warmup", "50"], "--warmup (50) must be smaller than --steps (8)"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
        (["--lr", "-1"], "argument --lr: must be > 0, got -1"),
        (["--clip", "-1"], "argument --clip: must be > 0, got -1"),
        (["--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
        (["--checkpoint", "SMALL_CONTEXT", "--seq-len", "32"],
         "--seq-len 32 is beyond the model's max_position_embeddings 16"),
    ],
)  # fmt: skip
def test_recipe_rejects_bad_flags(tmp_path, flags, message):
    """Each is refused by name before training starts (none had been: they trained, or deleted
    every checkpoint at the end with --keep-checkpoints 0)."""
    args, env = _recipe(tmp_path / "run")
    flags = [str(_small_context_checkpoint(tmp_path)) if f == "SMALL_CONTEXT" else f for f in flags]
    out = subprocess.run([*args, *flags], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_default_warmup_follows_steps():
    """``--steps 20`` alone was refused: the default warm-up (20) was not smaller than it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_recipe", ROOT / "recipes" / "train.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert recipe.parse_args(["--steps", "20"]).warmup == 2
    assert recipe.parse_args(["--steps", "1"]).warmup == 0
    assert recipe.parse_args([]).warmup == 20  # the default 250 steps: as before
    assert recipe.parse_args(["--steps", "20", "--warmup", "5"]).warmup == 5


@pytest.mark.parametrize(
    "field, value, message",
    [("keep_checkpoints", 0, "keep_checkpoints must be >= 1"), ("lr", -1.0, "lr must be > 0"),
     ("clip", -1.0, "clip must be > 0"), ("lr", float("nan"), "lr must be > 0")],
)  # fmt: skip
def test_train_config_refuses_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**{field: value})


def _saved(run_dir: Path, model, cfg) -> dict[int, dict]:
    """Every checkpoint in ``run_dir``, restored with orbax itself."""
    import orbax.checkpoint as ocp

    params = eqx.filter(model, eqx.is_inexact_array)
    abstract = {"params": params, "opt_state": ztrain.optimizer(cfg, model).init(params)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract)
    manager = ocp.CheckpointManager((run_dir / "checkpoints").absolute())
    return {s: manager.restore(s, args=ocp.args.StandardRestore(abstract)) for s in manager.all_steps()}


def _all_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact))


@pytest.mark.parametrize("log_every", [1, 100])
def test_nan_guard_never_writes_non_finite_values(corpus, tmp_path, log_every):
    """At lr 1e3 the update of step 7 turns the parameters NaN while the loss it reports (of the
    parameters before it) is finite. Neither the step-7 checkpoint nor a NaN metric may be
    written, and the stop message names the last checkpoint, which is finite. With log_every 100
    only the check before the save stands in the way."""
    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    cfg = _cfg(steps=12, lr=1e3, log_every=log_every, eval_every=100, checkpoint_every=3)
    ztrain.train(model, corpus, cfg, run_dir=tmp_path, stop_after=3)  # a good checkpoint at step 3
    with pytest.raises(ztrain.NonFiniteLoss) as err:
        ztrain.train(model, corpus, dataclasses.replace(cfg, checkpoint_every=7), run_dir=tmp_path, resume=True)
    saved = _saved(tmp_path, model, cfg)
    assert all(_all_finite(tree) for tree in saved.values()), {s: _all_finite(t) for s, t in saved.items()}
    assert f"last good checkpoint (step {max(saved)}," in str(err.value)
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text, text  # how json.dumps writes them (not JSON)


def test_a_run_dir_holding_a_run_is_refused_unless_resumed_or_overwritten(corpus, tmp_path):
    """A second run into the same dir trained from scratch, appended to the first's metrics and
    crashed at its first checkpoint."""
    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    cfg = _cfg(steps=3)
    ztrain.train(model, corpus, cfg, run_dir=tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    message = f"run dir {tmp_path} holds a previous run (metrics.jsonl, loss.png, checkpoints, run.json, events.out.tfevents.*)"
    with pytest.raises(ztrain.RunDirError, match=re.escape(message) + ".*--resume.*--overwrite"):
        ztrain.train(model, corpus, cfg, run_dir=tmp_path)
    args, env = _recipe(tmp_path)
    out = subprocess.run(args, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""  # before building anything
    assert (tmp_path / "metrics.jsonl").read_text() == before
    _, history = ztrain.train(model, corpus, cfg, run_dir=tmp_path, overwrite=True)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == history and [r["step"] for r in records] == [0, 1, 2, 3]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # the old run's events went too


def test_a_run_dir_in_use_is_refused(corpus, tmp_path):
    """Two runs into one dir interleaved their metrics and checkpoints; the lock of a running
    one (here: held by the test) refuses the second."""
    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    with open(tmp_path / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ztrain.RunDirError, match=re.escape(f"run dir {tmp_path} is in use by another run")):
            ztrain.train(model, corpus, _cfg(), run_dir=tmp_path)
        args, env = _recipe(tmp_path)
        out = subprocess.run(args, check=False, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and f"run dir {tmp_path} is in use by another run" in out.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_drops_the_metrics_after_the_checkpoint(corpus, tmp_path):
    """Steps 4 and 5 ran after the step-3 checkpoint: the resumed run logs them again, once."""
    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    ztrain.train(model, corpus, _cfg(), run_dir=tmp_path, stop_after=5)
    ztrain.train(model, corpus, _cfg(), run_dir=tmp_path, resume=True)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):
    """A finished run of ``_cfg()`` (checkpoints at steps 3 and 6) and its metric records."""
    run = tmp_path_factory.mktemp("finished")
    _, history = ztrain.train(zoo.Llama(preset("tiny"), key=jr.key(0)), corpus, _cfg(), run_dir=run)
    return run, history


def test_resume_of_a_finished_run_says_so(corpus, finished_run, tmp_path, capsys):
    run = shutil.copytree(finished_run[0], tmp_path / "run")
    _, history = ztrain.train(zoo.Llama(preset("tiny"), key=jr.key(0)), corpus, _cfg(), run_dir=run, resume=True)
    assert history == [] and f"run in {run} already finished at step 6; nothing to do" in capsys.readouterr().out


def _damage(step_dir: Path, how: str) -> None:
    if how == "one value's bit flipped":
        return _flip_a_saved_value(step_dir)
    default = step_dir / "default"
    data = max((default / "ocdbt.process_0" / "d").iterdir(), key=lambda f: f.stat().st_size)  # array bytes
    if how == "metadata removed":
        (default / "_METADATA").unlink()
    elif how == "data file removed":
        data.unlink()
    else:
        raw = bytearray(data.read_bytes())
        at, n, mask = len(raw) // 2, *((4096, 0xFF) if how == "4 KiB flipped" else (1, 0x01))
        raw[at : at + n] = bytes(b ^ mask for b in raw[at : at + n])
        data.write_bytes(bytes(raw))


def _flip_a_saved_value(step_dir: Path) -> None:
    """Save the checkpoint again, with the lowest bit of one parameter's value flipped and the
    old checksums: it restores, every value is finite, and only the checksums can tell."""
    import orbax.checkpoint as ocp

    step = int(step_dir.name)
    with ocp.CheckpointManager(step_dir.parent.absolute(), item_handlers=ocp.StandardCheckpointHandler()) as manager:
        tree, custom = manager.restore(step), manager.metadata(step).custom_metadata
        weight = np.array(tree["params"]["embed"])
        bits = weight.view(np.uint32).reshape(-1)
        bits[bits.size // 2] ^= 1
        tree["params"]["embed"] = weight
        manager.delete(step)
        manager.save(step, args=ocp.args.StandardSave(tree), custom_metadata=custom, force=True)
        manager.wait_until_finished()


# Bytes flipped in the files land where chance (the files' layout) puts them: in what orbax decodes,
# in a value (a non-finite one or a finite one the checksums catch), so each of those reasons is
# right there; the flipped value's bit is the case only the checksums can catch.
_REASONS = {
    "one bit flipped": ("does not match the checksum saved with it", "it does not restore", "is not finite"),
    "one value's bit flipped": ("its parameter embed does not match the checksum saved with it",),
}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's reads of a damaged checkpoint
@pytest.mark.parametrize(
    "how", ["metadata removed", "data file removed", "4 KiB flipped", "one bit flipped", "one value's bit flipped"]
)
def test_a_damaged_checkpoint_is_named_and_the_one_before_resumed(corpus, finished_run, tmp_path, capsys, how):
    """Resuming failed with orbax internals, or (flipped bytes) trained on from damaged values.
    One flipped bit leaves every value finite: the bit sums saved with the checkpoint catch it."""
    run = shutil.copytree(finished_run[0], tmp_path / "run")
    _damage(run / "checkpoints" / "6", how)
    _, rest = ztrain.train(zoo.Llama(preset("tiny"), key=jr.key(0)), corpus, _cfg(), run_dir=run, resume=True)
    err = capsys.readouterr().err
    assert f"checkpoint step 6 ({run / 'checkpoints' / '6'}) is damaged: " in err and "falling back to step 3" in err
    if how in _REASONS:
        assert any(reason in err for reason in _REASONS[how]), err
    assert (run / "damaged-checkpoints" / "6" / "default").is_dir()  # kept, out of the way of the new step 6
    assert [r["step"] for r in rest] == [4, 5, 6]
    full = [r["loss"] for r in finished_run[1] if "loss" in r]
    np.testing.assert_array_equal(full[3:], [r["loss"] for r in rest])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's reads of a damaged checkpoint
def test_no_usable_checkpoint_is_an_error_naming_each(corpus, finished_run, tmp_path):
    run = shutil.copytree(finished_run[0], tmp_path / "run")
    _damage(run / "checkpoints" / "6", "metadata removed")
    _damage(run / "checkpoints" / "3", "data file removed")
    message = (f"no checkpoint in {run / 'checkpoints'} is usable: step 6 ({run / 'checkpoints' / '6'}) is damaged: "
               f".*; step 3 ({run / 'checkpoints' / '3'}) is damaged: ")  # fmt: skip
    with pytest.raises(zoo.CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ztrain.train(zoo.Llama(preset("tiny"), key=jr.key(0)), corpus, _cfg(), run_dir=run, resume=True)
    assert sorted(os.listdir(run / "checkpoints")) == ["3", "6"]  # nothing moved: there is nothing to fall back to
    # A reader (eval, generate) says the same and leaves the run alone: no advice that deletes it.
    with pytest.raises(zoo.CheckpointError, match=r"\. The run directory is left as it is$") as err:
        ztrain.load_run(run)
    assert "--overwrite" not in str(err.value) and sorted(os.listdir(run / "checkpoints")) == ["3", "6"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's reads of a damaged checkpoint
def test_a_checkpoint_of_another_preset_is_a_one_line_error(corpus, finished_run, tmp_path):
    """It was orbax's shape error (262 lines of asyncio traceback from the recipe)."""
    run = shutil.copytree(finished_run[0], tmp_path / "run")
    with pytest.raises(zoo.CheckpointError) as err:
        ztrain.train(zoo.Llama(preset("small"), key=jr.key(0)), corpus, _cfg(), run_dir=run, resume=True)
    message = str(err.value)
    assert "parameter embed has shape (256, 64) in the checkpoint, (256, 256) in the model" in message
    assert f"checkpoint step 6 ({run / 'checkpoints' / '6'})" in message and "\n" not in message
    args, env = _recipe(run, "--preset", "small", "--resume")
    out = subprocess.run(args, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"train.py: error: {message}"


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


def test_recipe_help_lists_every_familys_options():
    help_text = _recipe_module().parser().format_help()
    assert all(f in help_text for f in ("--aux-loss-coef", "--mtp-weight", "--router-bias-rate", "qwen3_moe"))


def _recipe_module():
    """recipes/train.py as a module (it is a script, not part of the package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "recipes" / "train.py"
    spec = importlib.util.spec_from_file_location("zoo_train_recipe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_placement_auto_plans_within_the_budget(tmp_path, capsys):
    """``--placement auto`` asks zoo.plan for the fastest map within ``--device-budget-gib``: a
    budget the unmapped step does not fit gets a map that recomputes, and the plan is printed."""
    model = zoo.Llama(zoo.llama.preset("tiny"), key=jr.key(0))
    at = {"seq_len": 64, "batch_size": 4}
    roomy = auto.plan_placement(model, None, **at, device_budget_gib=1)
    assert not roomy.placement.placed("remat")  # everything kept: nothing to save
    tight = auto.plan_placement(model, None, **at, device_budget_gib=4.8 / 1024)  # under the unmapped 5.8 MiB
    assert tight.placement.placed("remat")
    assert tight.param_memory == tight.opt_memory == "device"  # one memory on CPU: nothing offloaded
    assert "chosen: batch 4" in capsys.readouterr().out
    with pytest.raises(zoo.ConfigError):  # nothing fits: the planner's message
        auto.plan_placement(model, None, **at, device_budget_gib=1e-5)
    recipe = _recipe_module()  # the recipe: a usage error naming the flag
    with pytest.raises(SystemExit):
        recipe.main(["--preset", "tiny", "--seq-len", "64", "--batch-size", "4", "--placement", "auto",
                     "--device-budget-gib", "1e-5", "--run-dir", str(tmp_path / "run")])  # fmt: skip
    assert "--placement auto: " in capsys.readouterr().err


@pytest.mark.parametrize("kind, name", [("NVIDIA H200", "h200"), ("NVIDIA GB200", "gb200"), ("NVIDIA B200", "b200"),
                                        ("TPU v5p", "tpu-v5p"), ("TPU v5", "tpu-v5p"), ("TPU v5 lite", "tpu-v5e"),
                                        ("TPU v6 lite", "tpu-v6e")])  # fmt: skip
def test_hardware_from_device_kind(kind, name):
    device = type("Device", (), {"platform": "gpu", "device_kind": kind})()
    assert auto.hardware_name(device) == name
    # Kinds not in zoo.plan's table, including those containing an entry's name (a GH200 is
    # not an H200): an error naming the kind and the flag that names one.
    for other in ("NVIDIA A100", "NVIDIA GH200 480GB"):
        with pytest.raises(zoo.ConfigError, match=f"device kind '{other}' is not in zoo.plan's hardware table .*--hardware"):
            auto.hardware_name(type("Device", (), {"platform": "gpu", "device_kind": other})())


def test_a_process_reads_only_its_rows_of_each_batch(tmp_path):
    """``rows=`` reads only those rows of a batch (token windows and packed rows alike), equal to
    the same rows of the whole batch; place_batch puts such a partial batch on the devices as
    the global array, and a row this process did not read is an error naming it."""
    from zoo import data as zdata
    from zoo import parallel

    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"document {i}: " + "word " * (5 + i % 17) for i in range(200)))
    packed = zdata.load_data(str(text), 256, cache_dir=tmp_path / "cache")
    streams = [packed, TokenData(np.arange(5000) % 256, np.arange(600) % 256, 256, "synthetic")]
    mine = np.array([1, 2, 5, 6])
    for source in streams:
        whole = ztrain.as_batch(source.batch(3, 7, 8, 16))
        part = ztrain.as_batch(source.batch(3, 7, 8, 16, rows=mine))
        for key in whole:
            np.testing.assert_array_equal(part[key], whole[key][mine], err_msg=key)
    mesh = parallel.make_mesh("data=4", devices=jax.devices()[:4])
    whole = ztrain.as_batch(packed.batch(3, 7, 8, 16))
    every = np.arange(8)
    placed = ztrain.place_batch({k: v[every] for k, v in whole.items()}, mesh, micro=False, rows=every, batch_size=8)
    for key in whole:
        np.testing.assert_array_equal(np.asarray(placed[key]), whole[key], err_msg=key)
    with pytest.raises(ValueError, match=r"rows \[0, 1\] were not read by this process"):
        ztrain.place_batch({k: v[mine] for k, v in whole.items()}, mesh, micro=False, rows=mine, batch_size=8)
