"""zoo.train's face and what a run reports: every public name where the README and docs use it,
the package's modules each one concern, TensorBoard's own reader on a run's event files, and
Weights & Biases logging (a recording stand-in for the wandb module; the real one is optional)."""

from __future__ import annotations

import ast
import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import zoo
from zoo import train as ztrain
from zoo.data import stdlib_corpus
from zoo.llama import preset

ROOT = Path(__file__).resolve().parents[1]
TRAIN = Path(ztrain.__file__).parent

# What the README, docs, recipes and benchmarks use of zoo.train, and what users' code may use.
PUBLIC = ("TrainConfig", "optimizer", "learning_rate", "param_specs", "make_train_step", "make_eval", "train",
          "check_run_dir", "RunDirError", "NonFiniteLoss", "as_batch", "place_batch", "local_rows", "batches",
          "BATCH_FIELDS", "matmul_peak_flops", "device_memory_in_use", "plot_losses", "MetricsLog",
          "loss_and_metrics")  # fmt: skip


def _names_used_in_the_docs() -> set[str]:
    used = set()
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").glob("*.py"),
                 *(ROOT / "benchmarks").glob("*.py")]:  # fmt: skip
        text = path.read_text()
        used |= set(re.findall(r"zoo\.train\.(\w+)", text))
        used |= {n.strip() for group in re.findall(r"from zoo\.train import ([\w, ]+)", text) for n in group.split(",")}
        if re.search(r"from zoo import train\b", text):  # `train.X` after `from zoo import train`
            used |= set(re.findall(r"\b(?:z?train)\.([A-Za-z_]\w*)\(", text)) - {"train"} | {"train"}
    return used


def test_every_public_name_imports_where_the_readme_and_docs_show_it():
    used = _names_used_in_the_docs()
    assert {"make_train_step", "TrainConfig", "optimizer", "train", "matmul_peak_flops", "place_batch"} <= used
    for name in sorted(used | set(PUBLIC)):
        assert hasattr(ztrain, name), f"zoo.train.{name} is used in the docs but no longer importable"
    assert callable(ztrain.train) and ztrain.train.__module__ == "zoo.train.loop"
    from zoo.train import TrainConfig, make_train_step, matmul_peak_flops, optimizer  # the README's and benchmarks' spelling

    assert TrainConfig is ztrain.TrainConfig and make_train_step and optimizer and matmul_peak_flops
    from zoo.metrics_log import TensorBoardWriter, read_events  # the older module's names

    assert TensorBoardWriter is ztrain.TensorBoardWriter and read_events


def test_each_training_module_owns_one_concern_and_none_imports_the_loop():
    modules = sorted(p for p in TRAIN.glob("*.py") if p.name != "__init__.py")
    assert {p.stem for p in modules} == {"config", "batch", "step", "checkpoints", "run_dir", "metrics", "preemption", "restore",
                                         "verify", "hlo", "profile", "trace_report", "op_names", "loop", "setup", "export", "run_data", "trace_files", "resume"}
    for path in modules:
        text = path.read_text()
        assert len(text.splitlines()) <= 300, f"{path.name} has {len(text.splitlines())} lines"
        assert ast.get_docstring(ast.parse(text)), f"{path.name} has no opening docstring saying what it owns"
        if path.stem != "loop":
            assert "zoo.train.loop" not in text and "from zoo.train import train" not in text, path.name


def test_zoo_no_longer_encodes_protobufs_or_crcs():
    for path in [*Path(zoo.__file__).parent.rglob("*.py")]:
        text = path.read_text()
        assert "0x82F63B78" not in text and "_varint" not in text, f"{path} hand-encodes TensorBoard's format"


@pytest.fixture(scope="module")
def corpus():
    return stdlib_corpus(max_bytes=2**20)


def _run(corpus, run_dir, **kw):
    import jax.random as jr

    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    cfg = ztrain.TrainConfig(steps=4, batch_size=2, seq_len=32, warmup=1, log_every=1, eval_every=2, eval_batches=1,
                             checkpoint_every=2)  # fmt: skip
    return ztrain.train(model, corpus, cfg, run_dir=run_dir, placement="remat+query=device", **kw)


def test_tensorboard_reads_the_runs_scalars_and_settings(corpus, tmp_path):
    """TensorBoard's own event reader (what ``tensorboard --logdir`` runs) sees every scalar
    of metrics.jsonl, and the run's settings and placement map once as text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, history = _run(corpus, tmp_path)
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == history
    expected: dict[str, dict[int, float]] = {}
    for r in lines:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                expected.setdefault(k, {})[r["step"]] = v
    assert {"loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "lm_loss"} <= set(expected)
    assert set(acc.Tags()["scalars"]) == set(expected)
    for tag, by_step in expected.items():
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert got == pytest.approx(by_step, rel=1e-6), tag  # stored as float32
    texts = {t: acc.Tensors(t) for t in acc.Tags()["tensors"]}
    assert set(texts) == {"config/text_summary", "placement/text_summary"}
    (placement,) = texts["placement/text_summary"]
    spec = zoo.LlamaPlacement.parse("remat+query=device").spec()
    assert spec in placement.tensor_proto.string_val[0].decode()
    (config,) = texts["config/text_summary"]
    settings = json.loads(config.tensor_proto.string_val[0].decode().strip("`\n"))
    assert settings["train"]["steps"] == 4 and settings["model"] == "Llama" and settings["placement"] == spec
    assert settings["model_config"]["hidden_size"] == preset("tiny").hidden_size


def test_the_old_event_reader_checks_crcs(tmp_path):
    from zoo.metrics_log import read_events

    with ztrain.TensorBoardWriter(tmp_path) as w:
        w.scalars(0, {"val_loss": 5.5})
        w.scalars(25, {"loss": 2.25, "lr": 1e-3, "skipped_nan": float("nan"), "skipped_list": [1, 2], "none": None})
    (path,) = tmp_path.glob("events.out.tfevents.*")
    events = read_events(path)
    assert events[0]["file_version"] == "brain.Event:2"
    scalars = [(e["step"], e["scalars"]) for e in events[1:]]
    assert scalars == [(0, {"val_loss": 5.5}), (25, {"loss": 2.25}), (25, {"lr": pytest.approx(1e-3)})]
    raw = bytearray(path.read_bytes())
    raw[-6] ^= 1
    (tmp_path / "bad").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"record 3 at byte \d+ fails its CRC"):
        read_events(tmp_path / "bad")


class _FakeWandb(types.ModuleType):
    """What zoo asks of wandb, recorded: ``init``'s arguments, each ``log``, ``finish``."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logs, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        fake = self

        class Run:
            id = kw.get("id") or f"run{len(fake.inits)}"

            def log(self, values, step):
                fake.logs.append((step, dict(values)))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_logs_the_same_scalars_and_a_resume_continues_its_run(corpus, tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    _, history = _run(corpus, tmp_path, wandb="zoo-tests", stop_after=2)
    (init,) = fake.inits
    assert init["project"] == "zoo-tests" and init["dir"] == str(tmp_path) and init["resume"] is None
    assert init["config"]["train"]["steps"] == 4 and init["config"]["placement"].startswith("layer_input=")
    assert fake.finished == 1
    logged = {step: values for step, values in fake.logs}
    for r in history:
        want = {k: v for k, v in r.items() if k != "step" and isinstance(v, float) and np.isfinite(v)}
        assert logged[r["step"]] == pytest.approx(want)
    assert (tmp_path / "wandb" / "zoo-run-id").read_text() == "run1"
    _run(corpus, tmp_path, wandb="zoo-tests", resume=True)
    assert fake.inits[1]["id"] == "run1" and fake.inits[1]["resume"] == "allow"
    assert max(step for step, _ in fake.logs) == 4 and fake.finished == 2


def test_wandb_missing_is_a_clear_error(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(zoo.ConfigError, match=r"the wandb package is not installed \(pip install wandb"):
        _run(corpus, tmp_path, wandb="p")
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_recipe", ROOT / "recipes" / "train.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with pytest.raises(SystemExit):
        recipe.main(["--wandb", "p", "--run-dir", str(tmp_path / "r"), "--steps", "1"])
    assert "--wandb: the wandb package is not installed" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before anything ran
