"""What skeptical probes broke (issue 30), each fixed: nothing lost, nothing silently wrong."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import FIXTURES
from helpers import free_port

import zoo
from zoo import generate as gen
from zoo import train as ztrain
from zoo.hf.safetensors import CheckpointFiles, write_safetensors
from zoo.llama import preset

ROOT = Path(__file__).resolve().parents[1]
LLAMA = FIXTURES / "llama3_1-tiny"


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_recipe_probes", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_save_keeps_safetensors_files_it_does_not_write(tmp_path):
    """Point 2: model-orig.safetensors and model_backup.safetensors beside a checkpoint were deleted."""
    out = tmp_path / "ckpt"
    shutil.copytree(LLAMA, out)
    mine = {"model-orig.safetensors": b"orig", "model_backup.safetensors": b"backup", "README.md": b"notes"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    zoo.save_pretrained(zoo.from_pretrained(LLAMA), out, max_shard_bytes=100_000)  # sharded: the single file goes
    assert {name: (out / name).read_bytes() for name in mine} == mine
    assert not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").exists()


def test_a_single_file_beside_an_index_is_what_loads_as_in_transformers(tmp_path):
    """Point 7: with model.safetensors and an index both present, zoo read the index's files."""
    d = tmp_path / "both"
    zoo.save_pretrained(zoo.from_pretrained(LLAMA), d, max_shard_bytes=100_000)
    files = CheckpointFiles(d)
    tensors = [(k, np.asarray(files.get(k)) + 1) for k in sorted(files.keys())]
    write_safetensors(d / "model.safetensors", tensors)
    assert CheckpointFiles(d).where == {k: "model.safetensors" for k, _ in tensors}
    np.testing.assert_array_equal(CheckpointFiles(d).get(tensors[0][0]), tensors[0][1])


def test_generation_refuses_ids_outside_the_vocabulary():
    """Point 5: prompt ids 261 or -2 (vocabulary 256), or a pad_id of 256, generated silently."""
    model = zoo.from_pretrained(LLAMA)
    for bad, where in ((261, "input_ids\\[0, 1\\] = 261"), (-2, "input_ids\\[0, 1\\] = -2")):
        with pytest.raises(ValueError, match=f"{where} is outside the model's vocabulary 0..255"):
            gen.generate(model, jnp.asarray([[1, bad, 3]], jnp.int32), max_new_tokens=2)
    ids, lengths = gen.pad_prompts([[1, 2, 3], [4]], pad_id=256)
    with pytest.raises(ValueError, match=r"input_ids\[1, 1\] = 256 is outside .* pad_id must be a token id"):
        gen.generate(model, ids, lengths, max_new_tokens=2)
    with pytest.raises(ValueError, match="pad_id 300 is outside the model's vocabulary"):
        next(iter(gen.stream(model, jnp.asarray([[1, 2]], jnp.int32), max_new_tokens=2, pad_id=300)))


def test_values_that_mean_nothing_are_refused_up_front(tmp_path, capsys):
    """Point 8: a negative planner margin, max_shard_bytes=-1, --eos 99999, --cpu-devices -2,
    and --warmup 0 starting at lr 0."""
    from zoo import plan
    from zoo.llama import preset

    with pytest.raises(zoo.ConfigError, match=r"margin is the fraction of each budget kept free, in \[0, 1\); got -3.0"):
        plan.plan(preset("tiny"), seq_len=64, batch_size=2, hardware="h100", margin=-3.0, verify=False)
    with pytest.raises(ValueError, match="max_shard_bytes must be a positive number of bytes, got -1"):
        zoo.save_pretrained(zoo.from_pretrained(LLAMA), tmp_path / "x", max_shard_bytes=-1)
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        _recipe("generate").main([str(LLAMA), "--eos", "99999"])
    assert "--eos 99999 is outside the model's vocabulary 0..255" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _recipe("train").parse_args(["--cpu-devices", "-2"])
    assert "--cpu-devices must be >= 1, got -2" in capsys.readouterr().err
    schedule = ztrain.learning_rate(ztrain.TrainConfig(steps=10, warmup=0, lr=1e-3))
    assert float(schedule(0)) == pytest.approx(1e-3) and float(schedule(10)) == pytest.approx(1e-4)
    warm = ztrain.learning_rate(ztrain.TrainConfig(steps=10, warmup=2, lr=1e-3))
    assert float(warm(0)) == 0.0 and float(warm(2)) == pytest.approx(1e-3)  # a warm-up still starts at 0


def _run(corpus, run_dir, **kw):
    cfg = dict(steps=4, batch_size=2, seq_len=16, warmup=1, lr=3e-3, log_every=1, eval_every=4, eval_batches=1,
               checkpoint_every=2)  # fmt: skip
    options = {k: kw.pop(k) for k in ("resume", "overwrite", "sources", "allow_change", "stop_after") if k in kw}
    model = zoo.Llama(preset("tiny"), key=jr.key(0), param_dtype=kw.pop("param_dtype", jnp.float32))
    return ztrain.train(model, corpus, ztrain.TrainConfig(**{**cfg, **kw}), run_dir=run_dir, **options)


@pytest.fixture(scope="module")
def corpus():
    from zoo.data import stdlib_corpus

    return stdlib_corpus(max_bytes=2**20)


def test_overwrite_refuses_to_remove_what_is_not_the_runs(corpus, tmp_path):
    """Point 1: --overwrite deleted a Hugging Face model folder and a README kept under checkpoints/."""
    _run(corpus, tmp_path, steps=2)
    (tmp_path / "checkpoints" / "my-model").mkdir()
    (tmp_path / "checkpoints" / "my-model" / "config.json").write_text("{}")
    (tmp_path / "checkpoints" / "README.md").write_text("notes")
    message = (f"--overwrite would remove {tmp_path}'s checkpoints, and they hold what is not the run's: "
               f"{tmp_path / 'checkpoints' / 'README.md'}, {tmp_path / 'checkpoints' / 'my-model'}")  # fmt: skip
    for refuse in (lambda: ztrain.check_run_dir(tmp_path, overwrite=True), lambda: _run(corpus, tmp_path, overwrite=True)):
        with pytest.raises(ztrain.RunDirError, match=re.escape(message)):
            refuse()
    assert (tmp_path / "checkpoints" / "README.md").read_text() == "notes"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "README.md", "my-model"]
    shutil.rmtree(tmp_path / "checkpoints" / "my-model")
    (tmp_path / "checkpoints" / "README.md").unlink()
    _run(corpus, tmp_path, steps=2, overwrite=True)  # only the run's own entries: replaced


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's reads of a damaged checkpoint
@pytest.mark.parametrize("how", ["missing", "empty", "not JSON"])
def test_a_checkpoint_that_cannot_be_verified_is_not_trusted(corpus, tmp_path, capsys, how):
    """Point 3: without its _CHECKPOINT_METADATA (missing, empty, invalid JSON), a checkpoint with
    a flipped data byte resumed "at step 4" from corrupted weights."""
    _run(corpus, tmp_path)
    meta = tmp_path / "checkpoints" / "4" / "_CHECKPOINT_METADATA"
    assert meta.is_file()
    if how == "missing":
        meta.unlink()
    else:
        meta.write_text("" if how == "empty" else "{not json")
    _, rest = _run(corpus, tmp_path, resume=True)
    err = capsys.readouterr().err
    assert f"checkpoint step 4 ({tmp_path / 'checkpoints' / '4'}) is damaged: it cannot be verified: " in err
    assert "falling back to step 2" in err and [r["step"] for r in rest] == [3, 4]


def test_a_resume_that_changes_the_runs_settings_is_refused_with_the_differences(corpus, tmp_path, capsys):
    """Points 4 and 9: --resume accepted other --batch-size, --seq-len, --seed, --lr, --data ... without
    a word (metrics.jsonl then mixed two runs); a --param-dtype change was called a damaged checkpoint,
    with advice (--overwrite) that would have destroyed a good one."""
    sources = {"data": "/data/a.txt", "checkpoint": None}
    _, full = _run(corpus, tmp_path / "full", sources=sources)
    run = tmp_path / "run"
    _run(corpus, run, sources=sources, stop_after=2)
    cases = [({"lr": 1e-3}, "lr 0.003 -> 0.001"), ({"batch_size": 4}, "batch_size 2 -> 4"),
             ({"seq_len": 8}, "seq_len 16 -> 8"), ({"seed": 1}, "seed 0 -> 1"),
             ({"sources": {"data": "/data/b.txt", "checkpoint": None}}, "data '/data/a.txt' -> '/data/b.txt'"),
             ({"param_dtype": jnp.bfloat16}, "param_dtype 'float32' -> 'bfloat16'")]  # fmt: skip
    for change, listed in cases:
        with pytest.raises(ztrain.RunDirError) as e:
            _run(corpus, run, resume=True, **{"sources": sources, **change})
        assert f"--resume would change the settings the run in {run} was made with (run.json): {listed}." in str(e.value)
        assert str(e.value).endswith(f"--allow-change {listed.split()[0]}")
    with pytest.raises(ztrain.RunDirError, match="--allow-change lr_max: not a setting of this run"):
        _run(corpus, run, resume=True, sources=sources, allow_change=["lr_max"])
    # What never changes the numbers resumes freely; the same settings resume exactly.
    _, rest = _run(corpus, run, resume=True, sources=sources, log_every=2, eval_batches=2)
    assert [r["loss"] for r in rest if "loss" in r] == [r["loss"] for r in full if r["step"] == 4]
    # Allowed: a changed dtype restores (verified as saved, then cast) and trains on.
    other = tmp_path / "other"
    _run(corpus, other, sources=sources, stop_after=2)
    capsys.readouterr()
    model, rest = _run(corpus, other, resume=True, sources=sources, param_dtype=jnp.bfloat16, lr=1e-3,
                       allow_change=["param-dtype", "lr"])  # fmt: skip
    out = capsys.readouterr().out
    assert "resuming with changed settings: lr 0.003 -> 0.001, param_dtype 'float32' -> 'bfloat16'" in out
    assert "resumed from" in out and [r["step"] for r in rest if "loss" in r] == [3, 4]
    assert model.embed.dtype == jnp.bfloat16
    assert json.loads((other / "run.json").read_text())["param_dtype"] == "bfloat16"  # the run's settings now


STEPS = 14  # the SIGTERM test's run: stopped at step 3, the rest resumed


def _train_cmd(run_dir, *extra) -> list[str]:
    return [sys.executable, str(ROOT / "recipes" / "train.py"), "--preset", "tiny", "--steps", str(STEPS), "--warmup", "2",
            "--batch-size", "4", "--seq-len", "32", "--log-every", "1", "--eval-every", "100", "--checkpoint-every",
            "100", "--peak-tflops", "1", "--run-dir", str(run_dir), *extra]  # fmt: skip


def _losses(run_dir) -> dict[int, float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}  # later lines (a resumed run's) win


def _processes(cmd: list[str], n: int) -> tuple[list[list[str]], dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
    env |= {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    if n == 1:
        return [cmd], env
    port = free_port()
    return [[*cmd, "--mesh", "fsdp=4", "--cpu-devices", "2", "--coordinator", f"127.0.0.1:{port}", "--num-processes",
             str(n), "--process-id", str(i)] for i in range(n)], env  # fmt: skip


def _run_all(cmds, env) -> list[str]:
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def test_sigterm_saves_at_the_step_reached_and_resume_is_exact(tmp_path):
    """Point 16: on SIGTERM the run exited without saving (up to --checkpoint-every steps lost on
    every preemption). Now it finishes the step, saves it and exits 143; --resume then equals an
    uninterrupted run bit for bit. Two processes: SIGTERM to process 1 alone, and both agree on
    the step through JAX's preemption service. (One process takes the same path: the Ctrl-C
    test below stops one and checks its save.)"""
    processes = 2
    full, cut = tmp_path / "full", tmp_path / "cut"
    _run_all(*_processes(_train_cmd(full), processes))
    cmds, env = _processes(_train_cmd(cut), processes)
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    seen = []
    for line in procs[0].stdout:  # a few steps in (no checkpoint yet: --checkpoint-every 100), then SIGTERM
        seen.append(line)
        if line.startswith("step 3/"):
            procs[-1].send_signal(signal.SIGTERM)
            break
    outs = ["".join(seen) + procs[0].stdout.read()] + [p.communicate(timeout=300)[0] for p in procs[1:]]
    for p, out in zip(procs, outs):
        assert p.wait(timeout=300) == 143, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    m = re.search(rf"train\.py: SIGTERM: stopped after step (\d+) of {STEPS}; saved checkpoint step (\d+) \((.*)\): "
                  r"--resume continues from it", outs[0])  # fmt: skip
    assert m and m[1] == m[2] and 3 <= int(m[1]) < STEPS and m[3] == str(cut / "checkpoints" / m[1]), outs[0][-2000:]
    assert sorted(os.listdir(cut / "checkpoints")) == [m[1]]
    cmds, env = _processes(_train_cmd(cut, "--resume"), processes)
    outs = _run_all(cmds, env)
    assert f"resumed from {cut / 'checkpoints'} at step {m[1]}" in outs[0]
    vals = [json.loads(x)["val_loss"] for x in (full / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert f"validation loss: {vals[0]:.3f} -> {vals[-1]:.3f}" in outs[0]  # the whole run's (point 15), not the session's
    steps = range(1, STEPS + 1)
    assert sorted(_losses(cut)) == list(steps)
    np.testing.assert_array_equal([_losses(cut)[s] for s in steps], [_losses(full)[s] for s in steps])


def test_ctrl_c_saves_at_the_step_reached_in_one_line(tmp_path):
    """Point 15: SIGINT printed a 26-line KeyboardInterrupt traceback and nothing about what was
    kept. A first Ctrl-C now stops as SIGTERM does (saved, exit 130); a second stops at once."""
    cmds, env = _processes(_train_cmd(tmp_path / "run", "--steps", "400"), 1)
    proc = subprocess.Popen(cmds[0], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step 5/"):
            proc.send_signal(signal.SIGINT)
            break
    out = proc.stdout.read()
    assert proc.wait(timeout=300) == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert re.fullmatch(r"train\.py: SIGINT: stopped after step (\d+) of 400; saved checkpoint step \1 "
                        rf"\({re.escape(str(tmp_path / 'run' / 'checkpoints'))}/\1\): --resume continues from it",
                        out.strip().splitlines()[-1]), out[-2000:]  # fmt: skip


def test_a_second_ctrl_c_stops_at_once_naming_the_last_checkpoint(corpus, tmp_path, monkeypatch):
    from zoo.train import loop, preemption

    stops = preemption.StopSignals()
    stops._handle(signal.SIGINT, None)  # the first: a stop at the next step boundary
    assert stops.reached(3)
    with pytest.raises(KeyboardInterrupt):
        stops._handle(signal.SIGINT, None)
    place, steps = loop.place_batch, []

    def interrupted_in_step_4(batch, *args, micro=True, **kw):  # a Ctrl-C while step 4 runs
        if micro and len(steps) == 3:
            raise KeyboardInterrupt
        steps.append(1) if micro else None
        return place(batch, *args, micro=micro, **kw)

    monkeypatch.setattr(loop, "place_batch", interrupted_in_step_4)
    with pytest.raises(ztrain.Interrupted) as e:
        _run(corpus, tmp_path, steps=8)
    assert str(e.value) == (f"interrupted after step 3; the last checkpoint is checkpoint step 2 "
                            f"({tmp_path / 'checkpoints' / '2'}): --resume continues from it")  # fmt: skip


def _cached(path, cache, **kw):
    from zoo.data import load_data, load_tokenizer

    return load_data(str(path), 256, tokenizer=load_tokenizer(FIXTURES / "tokenizer-tiny"), cache_dir=cache, **kw)


def test_the_data_cache_is_keyed_on_contents(tmp_path, capsys):
    """Point 6: a same-size edit with the modification time put back reused the stale tokens."""
    path = tmp_path / "a.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    first = _cached(path, tmp_path / "c")
    st = path.stat()
    path.write_text("the quick brown cat jumps over the lazy dog\n" * 40)  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    capsys.readouterr()
    second = _cached(path, tmp_path / "c")
    assert "tokenized" in capsys.readouterr().err and second.meta["cache"] != first.meta["cache"]
    assert not np.array_equal(np.asarray(second.docs.tokens), np.asarray(first.docs.tokens))
    third = _cached(path, tmp_path / "c")  # unchanged since: the remembered hash, the same entry
    assert third.meta["cache"] == second.meta["cache"] and "tokenized" not in capsys.readouterr().err


@pytest.mark.parametrize("how", ["zeroed tokens", "truncated tokens", "meta dtype edited", "meta deleted"])
def test_a_damaged_cache_entry_is_named_and_tokenized_again(tmp_path, capsys, how):
    """Points 6 and 14: zeroed bytes in tokens.bin trained silently; a truncated tokens.bin or an
    edited dtype gave "mmap length is greater than file size" with no path; with meta.json deleted
    every later run failed with FileNotFoundError (the entry never healed)."""
    path = tmp_path / "a.txt"
    path.write_text("".join(f"line {i} of a small corpus to tokenize\n" for i in range(200)))
    good = _cached(path, tmp_path / "c")
    entry, want = Path(good.meta["cache"]), np.array(good.docs.tokens)  # a copy: the entry is memory-mapped
    del good
    tokens = entry / "tokens.bin"
    if how == "zeroed tokens":
        raw = bytearray(tokens.read_bytes())
        raw[100:140] = bytes(40)
        tokens.write_bytes(bytes(raw))
    elif how == "truncated tokens":
        tokens.write_bytes(tokens.read_bytes()[:-64])
    elif how == "meta dtype edited":
        meta = json.loads((entry / "meta.json").read_text())
        (entry / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))
    else:
        (entry / "meta.json").unlink()
    capsys.readouterr()
    for _ in range(2):  # healed: the second run reads the new entry
        again = _cached(path, tmp_path / "c")
        np.testing.assert_array_equal(np.asarray(again.docs.tokens), want)
    err = capsys.readouterr().err
    said = "is incomplete (no meta.json)" if how == "meta deleted" else "is damaged: "
    assert f"data cache: {entry} {said}" in err and err.count("removed it, tokenizing again") == 1, err
    assert [p.name for p in (tmp_path / "c").iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("flags, message", [
    (["--data", "{empty}"], "{empty}: the train split has 0 tokens, fewer than seq_len + 1 = 33 (--seq-len 32)"),
    (["--data", "{ten}"], "{ten}: the train split has 9 tokens, fewer than seq_len + 1 = 33 (--seq-len 32)"),
    (["--seq-len", "1"], "--seq-len must be >= 2 (a next-token loss predicts position t+1 from t), got 1"),
    (["--placement", "save_matmul"], "--placement save_matmul: LlamaPlacement has no preset 'save_matmul' (did you mean "
                                     "'save_matmuls'?)"),
    (["--mesh", "data=2", "--cpu-devices", "2", "--batch-size", "3"],
     "--mesh data=2: batch_size (--batch-size) 3 is not divisible by the mesh's batch axes data=2 = 2"),
    (["--mesh", "context=2", "--cpu-devices", "2", "--seq-len", "66"],
     "--mesh context=2: seq_len (--seq-len) 66 is not divisible by 4: the mesh's context=2 cuts each sequence into 4"),
    (["--save-hf", "{file}"], "--save-hf {file}: {file}: exists and is not a directory"),
    (["--save-hf", "{file}/out"], "--save-hf {file}/out: {file}/out: cannot be made, {file} is a file"),
    (["--checkpoint", "{ckpt}", "--save-hf", "{ckpt}"],
     "--save-hf {ckpt} is the --checkpoint being fine-tuned: saving there would replace its base weights"),
    (["--save-hf", "{ckpt}"], ("--save-hf {ckpt} is not empty (config.json, generation_config.json, model.safetensors "
                               "and 1 more) and not this run's own export: saving would replace it; choose another "
                               "directory, or --overwrite-hf to replace it")),
    (["--overwrite-hf"], "--overwrite-hf needs --save-hf DIR (the export it lets replace)"),
])  # fmt: skip
def test_bad_values_are_refused_before_anything_runs(tmp_path, flags, message):
    """Points 11 and 12: these failed late, as tracebacks (52 lines for --placement save_matmul,
    an empty text file or a 10-token .npy at the first batch,
    jax's IndivisibleError for the batch), or after training (--save-hf onto a file; onto the
    checkpoint: its base weights replaced, then shutil.SameFileError)."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty.txt").write_text("")
    np.save(tmp_path / "ten.npy", np.arange(10, dtype=np.uint16))
    ckpt = shutil.copytree(LLAMA, tmp_path / "ckpt")
    fill = {"file": str(tmp_path / "file"), "ckpt": str(ckpt), "empty": str(tmp_path / "empty.txt"),
            "ten": str(tmp_path / "ten.npy")}  # fmt: skip
    cmd = [*_train_cmd(tmp_path / "run"), *(f.format(**fill) for f in flags)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"train.py: error: {message.format(**fill)}" in out.stderr, out.stderr[-2000:]
    assert "step 1/" not in out.stdout and not (tmp_path / "run" / "checkpoints").exists()
    assert CheckpointFiles(ckpt).keys() == CheckpointFiles(LLAMA).keys()  # the base weights untouched


@pytest.mark.parametrize("template, said", [
    ("{% for m in messages %}{{ m['content'] }", "does not parse: line 1: "),
    ("{{ messages[0]['content'] + 1 }}", "failed: TypeError: "),
    ("{{ raise_exception('roles must alternate') }}", "failed: roles must alternate"),
])  # fmt: skip
def test_a_broken_chat_template_is_named_by_file_and_field(tmp_path, template, said):
    """Point 13: a broken chat template gave a 40-line jinja2 traceback naming neither."""
    from zoo.data import ChatEncoder, load_tokenizer

    ckpt = shutil.copytree(FIXTURES / "tokenizer-tiny", tmp_path / "ckpt")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    with pytest.raises(zoo.data.DataError) as e:
        ChatEncoder(load_tokenizer(ckpt)).encode([{"role": "user", "content": "hi"}])
    assert str(e.value).startswith(f"the chat template in {ckpt / 'tokenizer_config.json'}'s chat_template {said}")


def test_save_pretrained_to_the_working_directory_or_under_a_file(tmp_path, monkeypatch):
    """Point 15: save_pretrained(m, ".") failed ("PosixPath('.') has an empty name"); a parent
    that is a file gave a raw FileExistsError."""
    model = zoo.from_pretrained(LLAMA)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    zoo.save_pretrained(model, ".")
    assert CheckpointFiles(tmp_path / "here").keys() == CheckpointFiles(LLAMA).keys()
    (tmp_path / "file").write_text("x")
    with pytest.raises(zoo.CheckpointError, match=re.escape(f"{tmp_path / 'file' / 'out'}: cannot be made, "
                                                           f"{tmp_path / 'file'} is a file")):  # fmt: skip
        zoo.save_pretrained(model, tmp_path / "file" / "out")


def test_a_save_that_cannot_write_is_one_line_naming_the_disk(tmp_path):
    """Point 10: a full disk during a save printed 590 lines of orbax tracebacks. Files over
    300 KB cannot be written here (RLIMIT_FSIZE: the OS refuses as on a full disk)."""
    cmd = _train_cmd(tmp_path / "run", "--steps", "6", "--checkpoint-every", "2")
    small_files = ["bash", "-c", "trap '' XFSZ; ulimit -f 293; exec \"$@\"", "-"]  # 293 KiB; writes past it fail
    out = subprocess.run([*small_files, *cmd], env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        f"train.py: error: saving a checkpoint to {tmp_path / 'run' / 'checkpoints'} failed: File too large (errno 27); "
        + out.stderr.split("(errno 27); ")[1].split(" free there")[0] + " free there. Nothing half-written remains; "
        "no checkpoint was kept"
    ], out.stderr[-3000:]
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []


def test_a_failed_save_names_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    save = ocp.CheckpointManager.save

    def full_at_step_4(self, step, *args, **kw):
        if step == 4:
            raise ValueError("OUT_OF_RANGE: Error writing ...: Failed to write 8 bytes [os_error_code='28']")
        return save(self, step, *args, **kw)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_at_step_4)
    with pytest.raises(ztrain.checkpoints.SaveFailed) as e:
        _run(corpus, tmp_path)
    assert re.fullmatch(rf"saving a checkpoint to {re.escape(str(tmp_path / 'checkpoints'))} failed: No space left on "
                        r"device \(errno 28\); [\d.]+ GiB free there. Nothing half-written remains; the last good "
                        rf"checkpoint is step 2 \({re.escape(str(tmp_path / 'checkpoints' / '2'))}\)", str(e.value))  # fmt: skip


def test_a_run_that_stopped_before_its_first_step_does_not_block_the_next(corpus, tmp_path, capsys):
    """Point 15: a run that failed before step 1 left an events file (and its step-0 record), and
    its corrected rerun was refused as "a previous run"."""
    (tmp_path / "events.out.tfevents.1796000000.host").write_bytes(b"x")
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 5.5}) + "\n")
    ztrain.check_run_dir(tmp_path)
    _, history = _run(corpus, tmp_path, steps=2)
    assert [r["step"] for r in history] == [0, 1, 2]
    assert "run dir: removed what a run that stopped before its first step left: metrics.jsonl, run.json, " in capsys.readouterr().out
    assert not (tmp_path / "events.out.tfevents.1796000000.host").exists()
    with pytest.raises(ztrain.RunDirError, match="holds a previous run"):  # this one trained: refused as before
        ztrain.check_run_dir(tmp_path)


def test_a_long_document_is_tokenized_in_pieces_to_the_same_ids(monkeypatch):
    """Point 15: one 50 MB document with a tokenizer peaked at 10.8 GB of resident memory (the
    tokenizers library holds some 200 bytes a token). Long texts are now cut where the tokenizer
    cuts anyway: the ids of the whole, a fraction of the memory."""
    from zoo.data import load_tokenizer
    from zoo.data import tokenizer as T

    tok = load_tokenizer(FIXTURES / "tokenizer-tiny")
    sources = sorted((ROOT / "zoo" / "hf").glob("*.py"))  # some 60 kB of Python
    text = ("".join(p.read_text() for p in sources) * 15)[:600_000]
    whole = np.asarray(tok.tok.encode(text, add_special_tokens=False).ids, np.int32)
    monkeypatch.setattr(T, "LONG_TEXT", 2**16)
    assert len(tok._pieces(text)) >= 8
    short, long = tok.encode_batch(["a short one", text])
    np.testing.assert_array_equal(long, whole)
    assert list(short) == tok.tok.encode("a short one", add_special_tokens=False).ids
    out = subprocess.run([sys.executable, "-c", f"""
import resource, sys
sys.path.insert(0, {str(ROOT)!r})
from zoo.data import load_tokenizer
tok = load_tokenizer({str(FIXTURES / "tokenizer-tiny")!r})
text = ("".join(open(p).read() for p in {[str(p) for p in sources]!r}) * 500)[: 20 * 2**20]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = tok.encode_batch([text])[0]
print(len(ids), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""], capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    tokens, grew = map(int, out.stdout.split())
    assert tokens > 10**7 and grew < 80 * tokens, grew / tokens  # bytes a token: ~290 encoded whole, ~45 in pieces


def test_overwrite_and_resume_accept_what_zoo_itself_left(corpus, tmp_path):
    """Review finds: a save killed midway leaves orbax's "4.orbax-checkpoint-tmp", which --overwrite
    called foreign; a run.json of an older zoo (without the dtypes and sources) refused every resume."""
    _run(corpus, tmp_path, steps=2)
    (tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp").mkdir()
    ztrain.check_run_dir(tmp_path, overwrite=True)
    _, history = _run(corpus, tmp_path, steps=4, stop_after=2, overwrite=True)
    settings = json.loads((tmp_path / "run.json").read_text())
    older = {k: v for k, v in settings.items() if k not in ("param_dtype", "compute_dtype", "sources")}
    (tmp_path / "run.json").write_text(json.dumps(older))
    _, rest = _run(corpus, tmp_path, steps=4, resume=True)
    assert [r["step"] for r in rest if "loss" in r] == [3, 4]


# -- issue 42 -------------------------------------------------------------------------------------


def test_save_hf_replaces_no_other_runs_export(tmp_path):
    """Point 7 (issue 42): two runs with the same --save-hf DIR both said "saved", the first
    export gone. A directory that is not empty is refused before training (the recipe's case is
    in test_bad_values_are_refused_before_anything_runs) unless --overwrite-hf, or it is the
    resumed run's own export (its run dir's hf-export.json names it)."""
    from zoo.train import setup

    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    out, first, second = tmp_path / "out", tmp_path / "first", tmp_path / "second"
    setup.check_save_hf(str(out), checkpoint=None, run_dir=str(first))
    setup.save_hf(model, str(out), checkpoint=None, generation=None, run_dir=str(first))
    assert json.loads((first / "hf-export.json").read_text()) == {"path": str(out.resolve())}
    said = re.escape(f"--save-hf {out} is not empty (config.json, ") + ".* and not this run's own export: saving would replace it"
    with pytest.raises(zoo.ConfigError, match=said):
        setup.check_save_hf(str(out), checkpoint=None, run_dir=str(second))
    with pytest.raises(zoo.ConfigError, match=said):  # the same run dir, not resumed: a new run (--overwrite)
        setup.check_save_hf(str(out), checkpoint=None, run_dir=str(first))
    setup.check_save_hf(str(out), checkpoint=None, run_dir=str(first), resume=True)  # its own export, again
    setup.check_save_hf(str(out), checkpoint=None, run_dir=str(second), overwrite_hf=True)
    assert "hf-export.json" in ztrain.run_dir.RUN_FILES  # --overwrite of the run forgets its export


def test_tensorboard_shows_each_step_once_after_a_kill_and_resume(corpus, tmp_path):
    """Point 8 (issue 42): after a kill and --resume, TensorBoard showed the steps run again twice
    (metrics.jsonl was de-duplicated, the event files were not). The resumed run's event file
    starts with a purge marker at the step after its checkpoint, and TensorBoard's own reader
    shows each step once, with the values metrics.jsonl holds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from zoo.metrics_log import read_events

    _run(corpus, tmp_path, stop_after=3)  # checkpoint at step 2, steps 1-3 logged: killed there
    _run(corpus, tmp_path, resume=True)  # resumed at step 2: steps 3 and 4 logged again
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 2
    assert not any("session_log" in e for e in read_events(files[0]))
    assert [(e["step"], e["session_log"]) for e in read_events(files[1]) if "session_log" in e] == [(3, "START")]
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    want = {r["step"]: r["loss"] for r in lines if "loss" in r}
    got = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in got] == [1, 2, 3, 4]
    assert dict(got) == pytest.approx(want, rel=1e-6)


def test_a_longer_resume_keeps_the_runs_schedule_unless_told(corpus, tmp_path, capsys):
    """Point 12 (issue 42): ``--resume --steps 500 --allow-change steps`` stretched the cosine decay
    over the new length, so the lr jumped from its final 5.0e-4 back to 2.9e-3. The decay now
    keeps its length and the extra steps go on at the final lr, said in one line; naming
    decay_steps too stretches it, saying so."""
    run, other = tmp_path / "run", tmp_path / "other"
    _run(corpus, run)  # 4 steps: the decay ends at step 4, lr 3e-4
    shutil.copytree(run, other)
    _run(corpus, run, steps=6, resume=True, allow_change=["steps"])
    out = capsys.readouterr().out
    original = ztrain.learning_rate(ztrain.TrainConfig(steps=4, warmup=1, lr=3e-3))
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    assert lrs[5] == pytest.approx(float(original(4))) and lrs[6] == pytest.approx(3e-4)  # the run's final lr
    assert (
        "learning rate: the schedule keeps its length: its decay ends at step 4 as before, and steps 5-6 go on "
        "at its final lr 3.00e-04 (--allow-change steps,decay_steps would stretch the decay to step 6)"
    ) in out
    assert json.loads((run / "run.json").read_text())["train"]["decay_steps"] == 4
    _run(corpus, other, steps=6, resume=True, allow_change=["steps", "decay_steps"])
    out = capsys.readouterr().out
    stretched = ztrain.learning_rate(ztrain.TrainConfig(steps=6, warmup=1, lr=3e-3))
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (other / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    assert lrs[5] == pytest.approx(float(stretched(4))) and lrs[5] > 1e-3
    assert "resuming with changed settings: decay_steps 4 -> 6, steps 4 -> 6" in out
    assert f"learning rate: the decay now ends at step 6, not 4: step 5 trains at lr {float(stretched(4)):.2e}" in out
    longer_warmup = ztrain.TrainConfig(steps=500, warmup=20)  # than the run's decay: not kept, said (no traceback)
    kept, said = ztrain.resume.keep_schedule(other, longer_warmup, 4)
    assert kept == longer_warmup and said.startswith("learning rate: the decay now ends at step 500, not 6")


def test_resume_says_which_run_it_continues(tmp_path, monkeypatch):
    """Point 12 (issue 42): the README said ``--resume`` continues "the latest run"; it continued
    runs/llama-small (the default --model/--preset's run dir), and after a Qwen3-MoE run said
    "nothing to do". The words now say what it does, and the recipe says, before anything runs,
    which run it continues, naming the latest run when that is another."""
    monkeypatch.chdir(tmp_path)
    for name in ("llama-small", "qwen3_moe-small"):  # the Qwen3-MoE run is the latest
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text('{"step": 0, "val_loss": 5.5}\n')
    os.utime(tmp_path / "runs" / "llama-small" / "metrics.jsonl", (1, 1))
    recipe = _recipe("train")
    latest = Path("runs") / "qwen3_moe-small"
    assert ztrain.run_dir.resume_target(recipe.parse_args(["--resume"])) == (
        f"--resume: continuing the run in {Path('runs') / 'llama-small'} (the run dir of --model llama --preset small; "
        f"another: --run-dir); the latest run is {latest}: resume it with --run-dir {latest} and the flags it was made with"
    )
    assert ztrain.run_dir.resume_target(recipe.parse_args(["--resume", "--model", "qwen3_moe"])) == (
        f"--resume: continuing the run in {latest} (the run dir of --model qwen3_moe --preset small; another: --run-dir)"
    )
    assert ztrain.run_dir.resume_target(recipe.parse_args(["--resume", "--run-dir", "elsewhere"])) == (
        "--resume: continuing the run in elsewhere (--run-dir)"
    )
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "training.md").read_text()
    assert "continue the latest run" not in readme


def test_eval_of_a_run_dir_prints_no_absl_warnings(corpus, tmp_path):
    """Point 15 (issue 42): every eval or generate of a run dir printed three ``WARNING:absl``
    lines, orbax's notes on the read-only checkpoint manager it opens: noise, now not shown."""
    _run(corpus, tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(ROOT / "recipes" / "eval.py"), str(tmp_path / "run"), "--max-rows", "2", "--batch-size", "2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "training run, its checkpoint of step 4" in out.stdout
    assert "WARNING:absl" not in out.stderr + out.stdout, out.stderr


def test_progress_lines_say_the_elapsed_time_and_eta(capsys):
    """Point 15 (issue 42): the main job's step lines had no elapsed time or ETA. Each says the
    session's elapsed time, and past the first step an ETA from the pace since the first step
    logged (compiling is not a step's pace); metrics.jsonl's records are unchanged."""
    log = ztrain.MetricsLog(None, 100)
    times = iter([0.5, 30.0, 31.0, 3700.0])
    log.clock, log.began = lambda: next(times), 0.0
    for step in (0, 1, 2, 100):
        log.write({"step": step, "loss": 1.0})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("loss 1.0000  ")[1] for line in lines] == [
        "elapsed 0s", "elapsed 30s  eta 49m30s", "elapsed 31s  eta 1m38s", "elapsed 1h01m  eta 0s"]  # fmt: skip
    assert log.history == [{"step": s, "loss": 1.0} for s in (0, 1, 2, 100)]


def test_pipeline_settings_the_run_cannot_use_are_refused_before_its_run_dir(corpus, tmp_path):
    """Issue 42, point 9: --microbatches 3 on 2 rows a device and --virtual-stages not dividing a
    stage's layers failed as 14-18-frame tracebacks from inside the step after the run dir was
    written; either without a pipeline axis was saved into run.json and blocked --resume."""
    import dataclasses

    from zoo import parallel
    from zoo.train import setup

    recipe = _recipe("train")

    def flags(*extra):
        return recipe.parse_args(["--preset", "tiny", "--batch-size", "8", "--run-dir", str(tmp_path / "run"), *extra])

    with pytest.raises(zoo.ConfigError, match=r"^--mesh pipeline=2,data=4: microbatches \(--microbatches\) 3 must "
                                              r"divide each device's 2 rows .*possible: \[1, 2\]$"):  # fmt: skip
        setup.make_mesh("pipeline=2,data=4", flags("--microbatches", "3"))
    for spec, flag in (("", "--microbatches"), ("data=8", "--virtual-stages")):
        with pytest.raises(zoo.ConfigError, match=f"^{flag} needs a pipeline axis in --mesh"):
            setup.make_mesh(spec, flags(flag, "2"))
    mesh = parallel.make_mesh("pipeline=2,data=4")
    model = zoo.Llama(preset("tiny"), key=jr.key(0))  # 2 layers: 1 a stage
    with pytest.raises(zoo.ConfigError, match=r"^--virtual-stages 2: virtual_stages=2 cannot split the 1 layers "
                                              r"per stage of LlamaConfig.num_layers = 2 on pipeline=2"):  # fmt: skip
        setup.check_model(model, seq_len=32, placement=None, mesh=mesh, virtual_stages=2)
    # 6 layers, 3 a stage: 3 chunks divide them (the vocabulary, 128 rows a stage, is no layer stack).
    parallel.validate_mesh(mesh, dataclasses.replace(preset("tiny"), num_layers=6), virtual_stages=3)
    # zoo.train itself refuses them before it writes the run dir (on one device they are ignored:
    # the reference run of a pipelined one takes the same TrainConfig).
    cfg = {"steps": 2, "batch_size": 8, "seq_len": 16, "warmup": 1}
    bad_ones = (({"microbatches": 3}, zoo.ConfigError), ({"microbatches": 2, "virtual_stages": 2}, zoo.MeshError))
    for bad, error in bad_ones:
        with pytest.raises(error):
            ztrain.train(model, corpus, ztrain.TrainConfig(**cfg, **bad), run_dir=tmp_path / "lib", mesh=mesh)
    assert not (tmp_path / "lib").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("fixture, name", [("llama3_1-tiny", "config.json"),
                                           ("llama3_1-tiny-sharded", "model.safetensors.index.json")])  # fmt: skip
def test_a_damaged_checkpoint_file_is_named(tmp_path, fixture, name):
    """Issue 42, point 9: recipes/train.py --checkpoint on a checkpoint whose config.json or
    safetensors index was overwritten with bytes that are not UTF-8 printed a 10-frame
    UnicodeDecodeError traceback; a config.json that is a directory, IsADirectoryError."""
    ckpt = shutil.copytree(FIXTURES / fixture, tmp_path / "ckpt")
    (ckpt / name).write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises((zoo.CheckpointError, zoo.ConfigError), match=f"^{re.escape(str(ckpt / name))}: not .*utf-8"):
        zoo.from_pretrained(ckpt)
    if name == "config.json":
        (ckpt / name).unlink()
        (ckpt / name).mkdir()
        with pytest.raises(zoo.ConfigError, match=f"^{re.escape(str(ckpt / name))}: .*Is a directory"):
            zoo.from_pretrained(ckpt)


@pytest.mark.parametrize("flags, said", [
    (["--max-rows", "0"], "argument --max-rows: must be >= 1, got 0"),
    (["--max-rows", "-2"], "argument --max-rows: must be >= 1, got -2"),
    (["--json", "{tmp}/missing/folder/x.json"], ("argument --json: {tmp}/missing/folder/x.json: the folder "
                                                 "{tmp}/missing/folder does not exist; create it first")),
    (["--json", "{tmp}"], "argument --json: {tmp} is a directory; name a file in it"),
])  # fmt: skip
def test_eval_refuses_its_flags_before_evaluating(tmp_path, capsys, flags, said):
    """Issue 42, point 9: eval.py --max-rows 0 / -2 blamed the data ("the valid split has no
    target tokens"); --json into a missing folder failed after the whole evaluation."""
    with pytest.raises(SystemExit) as e:
        _recipe("eval").main([str(LLAMA), *(f.format(tmp=tmp_path) for f in flags)])
    err = capsys.readouterr()
    assert e.value.code == 2 and f"error: {said.format(tmp=tmp_path)}" in err.err, err.err
    assert "evaluating" not in err.out


@pytest.mark.parametrize("name, said", [
    ("train", "rows of --seq-len tokens per micro-batch (default: 16)"), ("eval", "rows per forward pass (default: 8)"),
    ("generate", "(default: "), ("plan", "(default: llama)"), ("predict", "(default: 5)"), ("profile", "(default 15)"),
])  # fmt: skip
def test_every_recipe_s_help_shows_its_defaults(capsys, name, said):
    """Issue 42, point 14: recipes/train.py --help showed no defaults (--batch-size, --steps ...)."""
    with pytest.raises(SystemExit) as e:
        _recipe(name).main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    assert e.value.code == 0 and said in text, text[-3000:]
    assert "(default: None)" not in text


def test_the_package_says_its_version():
    """Issue 42, point 14: there was no zoo.__version__; it is pyproject.toml's."""
    import tomllib

    assert zoo.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("transformers") for d in extras["hf"])  # the README's "loadable by transformers"


def test_a_run_that_cycles_its_data_says_how_often(tmp_path):
    """Issue 42, point 14: a 20-chat set was seen ~447 times without a word; the recipe now
    prints how many epochs a run covers when it is more than one (packed rows, or tokens)."""
    from zoo import data as zdata
    from zoo.train import setup

    (tmp_path / "small.jsonl").write_text("".join(json.dumps({"text": f"document number {i}, " * 3}) + "\n"
                                                  for i in range(40)))  # fmt: skip
    packed = zdata.load_data(str(tmp_path / "small.jsonl"), 256, tokenizer=zdata.load_tokenizer(None),
                             cache_dir=str(tmp_path / "cache"))  # fmt: skip
    rows = packed.plan(32, "train").num_rows
    cfg = ztrain.TrainConfig(steps=rows, batch_size=2, seq_len=32, grad_accum=2, warmup=1)
    said = setup.epochs(packed, cfg)
    assert said.startswith(f"data: the run takes {4 * rows} rows of 32 tokens ({rows} steps x 4 rows) from a train "
                           f"split of {rows} rows of 32 tokens: about 4.0 epochs"), said  # fmt: skip
    assert setup.epochs(packed, ztrain.TrainConfig(steps=rows // 4, batch_size=4, seq_len=32, warmup=1)) is None
    stream = zdata.stdlib_corpus(max_bytes=2**16)
    many = ztrain.TrainConfig(steps=1000, batch_size=16, seq_len=128, warmup=1)
    assert " tokens (1000 steps x 16 rows) from a train split of " in setup.epochs(stream, many)


def _hub_cache(tmp_path, repo: str = "org/name") -> Path:
    """A hub cache (huggingface_hub's layout) holding the tiny Llama fixture as ``repo``'s main."""
    folder = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(LLAMA, folder / "snapshots" / commit, ignore=shutil.ignore_patterns("*.npz"))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return folder / "snapshots" / commit


def test_a_hub_id_loads_from_the_hub_cache(tmp_path, monkeypatch):
    """Issue 42, point 14: zoo.from_pretrained("org/name") and train.py --checkpoint org/name
    refused anything but a local folder; a hub id resolves as in transformers (here offline,
    from a filled cache), and without huggingface_hub the error says to install it (huggingface_hub
    is in the dev extra: this test always runs)."""
    snapshot = _hub_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder org/name
    model = zoo.from_pretrained("org/name")
    want = zoo.from_pretrained(LLAMA)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    flags = _recipe("train").parse_args(["--checkpoint", "org/name"])
    assert flags.checkpoint == str(snapshot) and flags.run_dir == str(Path("runs") / "name")
    with pytest.raises(zoo.CheckpointError, match=r"^org/other: no such local folder, and as a Hugging Face hub id it "
                                                  r"does not resolve \(not in the hub cache and HF_HUB_OFFLINE is set\)$"):  # fmt: skip
        zoo.from_pretrained("org/other")
    with pytest.raises(zoo.CheckpointError, match=r"^nothing-here: no such checkpoint directory"):
        zoo.from_pretrained("nothing-here")  # no hub id: a local path
    # eval.py reads the snapshot's tokenizer and weights: the hub id works there too.
    result = _recipe("eval").main(["org/name", "--seq-len", "16", "--max-rows", "1", "--batch-size", "1",
                                   "--data-cache", str(tmp_path / "cache")])  # fmt: skip
    assert result["checkpoint"] == str(snapshot) and result["tokens"] > 0
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    with pytest.raises(zoo.CheckpointError, match=r"^org/name: no such local folder; to load it as a Hugging Face hub "
                                                  r"id install huggingface_hub"):  # fmt: skip
        zoo.from_pretrained("org/name")


def test_a_hub_id_is_recorded_as_given(tmp_path, monkeypatch, capsys):
    """Issue 42: train.py --checkpoint org/name recorded in run.json the snapshot's path in this
    machine's hub cache, not the id; it records the id as given and the snapshot's revision, says
    the id in the run's line, and a resume resolves the id again (offline, from the cache)."""
    snapshot = _hub_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder org/name
    data = tmp_path / "d.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    run = tmp_path / "run"

    def train(*extra: str) -> None:
        _recipe("train").main(["--checkpoint", "org/name", "--data", str(data), "--data-cache", str(tmp_path / "c"),
                               "--batch-size", "2", "--seq-len", "16", "--eval-every", "100", "--checkpoint-every", "2",
                               "--peak-tflops", "1", "--run-dir", str(run), *extra])  # fmt: skip

    train("--steps", "2")
    sources = json.loads((run / "run.json").read_text())["sources"]
    assert sources["checkpoint"] == "org/name" and sources["checkpoint_revision"] == snapshot.name, sources
    assert " org/name: " in capsys.readouterr().out  # the run's line names the id, not the snapshot's path
    flags = _recipe("train").parse_args(["--checkpoint", "org/name", "--run-dir", str(Path("runs") / "name"), "--resume"])
    assert ztrain.run_dir.resume_target(flags).endswith("(the run dir of --checkpoint org/name; another: --run-dir)")
    train("--steps", "3", "--resume", "--allow-change", "steps")  # the id resolves again, equal to the run's
    assert json.loads((run / "run.json").read_text())["sources"] == sources
    assert ztrain.load_run(run)[1] == 3


def test_the_run_line_names_the_model_type_where_a_family_has_several():
    """Issue 42: --model qwen3_moe was announced as "Qwen3 small"."""
    from types import SimpleNamespace

    from zoo.qwen3 import preset as qwen3_preset
    from zoo.train import setup

    data = SimpleNamespace(source="stdlib", num_tokens=lambda split: 1000)
    moe = zoo.Qwen3(qwen3_preset("tiny", "qwen3_moe"), key=jr.key(0))
    assert setup.describe(moe, "tiny", data, 1e12).startswith("Qwen3 (qwen3_moe) tiny: ")
    assert setup.describe(zoo.Llama(preset("tiny"), key=jr.key(0)), "tiny", data, 1e12).startswith("Llama tiny: ")


def test_a_longer_resume_keeps_the_runs_warm_up(tmp_path):
    """A resume from 100 to 300 steps was refused: the warm-up's default follows --steps (10 ->
    20), a setting the user never gave. Unset, it is now the run's own."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"train": {"steps": 100, "warmup": 10}}))
    train = _recipe("train")
    assert train.parse_args(["--run-dir", str(run), "--resume", "--steps", "300"]).warmup == 10
    assert train.parse_args(["--run-dir", str(run), "--resume", "--steps", "300", "--warmup", "5"]).warmup == 5
    assert train.parse_args(["--run-dir", str(tmp_path / "new"), "--steps", "300"]).warmup == 20


def test_pipeline_settings_of_a_run_without_a_pipeline_do_not_block_its_resume(tmp_path):
    """Runs made before the recipe refused --microbatches/--virtual-stages without a pipeline
    axis recorded them; they do nothing there, so a resume without them is not refused."""
    settings = {"mesh": {"pipeline": 1, "fsdp": 8}, "train": {"steps": 4, "microbatches": 3, "virtual_stages": 2}}
    (tmp_path / "run.json").write_text(json.dumps(settings))
    now = {"mesh": {"pipeline": 1, "fsdp": 8}, "train": {"steps": 4, "microbatches": None, "virtual_stages": 1}}
    assert ztrain.resume.check_resume(tmp_path, now) == {}
    piped = {"mesh": {"pipeline": 2, "fsdp": 4}}
    (tmp_path / "run.json").write_text(json.dumps({**settings, **piped}))
    with pytest.raises(ztrain.RunDirError, match="microbatches 3 -> None"):
        ztrain.resume.check_resume(tmp_path, {**now, **piped})
