"""A newcomer's path with real checkpoints (issue 29): fine-tuning defaults that keep what a
pretrained model learned, every recipe speaking the checkpoint's tokenizer and chat template,
runs that chain (eval and generate on a training run directory), and honest labels and figures."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from conftest import FIXTURES

import zoo
from zoo import train as ztrain
from zoo.llama import preset

ROOT = Path(__file__).resolve().parents[1]
TINY = FIXTURES / "tokenizer-tiny"  # a tiny Llama with a 256-token BPE and a ChatML template


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_recipe_newcomer", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A pretrained-like checkpoint: the tiny preset trained 120 steps on the embedded corpus."""
    from zoo.data import stdlib_corpus

    out = tmp_path_factory.mktemp("pretrained")
    cfg = ztrain.TrainConfig(steps=120, batch_size=8, seq_len=64, warmup=10, lr=5e-3, log_every=60, eval_every=120,
                             eval_batches=2, checkpoint_every=120)  # fmt: skip
    model, history = ztrain.train(zoo.Llama(preset("tiny"), key=jax.random.key(0)), stdlib_corpus(max_bytes=2**20), cfg)
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 1.0  # it learned something to keep
    zoo.save_pretrained(model, out / "ckpt")
    return out / "ckpt"


def test_fine_tuning_a_checkpoint_gets_fine_tuning_defaults_and_keeps_its_loss(pretrained, tmp_path, capsys):
    recipe = _recipe("train")
    scratch, tuned = recipe.parse_args([]), recipe.parse_args(["--checkpoint", str(pretrained)])
    assert (scratch.lr, scratch.weight_decay) == (5e-3, 0.1)
    assert (tuned.lr, tuned.weight_decay) == (2e-5, 0.0)
    assert recipe.parse_args(["--checkpoint", str(pretrained), "--lr", "1e-4"]).lr == 1e-4
    recipe.main(["--checkpoint", str(pretrained), "--steps", "20", "--batch-size", "8", "--seq-len", "64",
                 "--eval-every", "20", "--log-every", "5", "--run-dir", str(tmp_path / "ft"), "--peak-tflops", "1"])  # fmt: skip
    records = [json.loads(x) for x in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert vals[-1] <= vals[0] + 1e-3, vals
    assert "warning: the loss rose" not in capsys.readouterr().err


def test_a_loss_that_rises_sharply_early_warns_naming_the_learning_rate(capsys):
    from zoo.train.loop import RisingLoss

    watch = RisingLoss(ztrain.TrainConfig(steps=100, lr=5e-3, warmup=0))
    for step, loss in ((5, 1.9), (10, 2.1), (15, 5.7), (20, 11.2)):
        watch.check(step, loss)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "rose from 1.900 at step 5 to 5.700 at step 15" in err and "(0.005)" in err
    calm = RisingLoss(ztrain.TrainConfig(steps=100, lr=5e-3, warmup=0))
    for step, loss in ((5, 5.5), (10, 5.0), (60, 9.0)):  # late, not early: no warning
        calm.check(step, loss)
    assert "warning" not in capsys.readouterr().err


def test_predict_prints_the_checkpoints_own_tokens(capsys):
    _recipe("predict").main([str(TINY), "--prompt", "the quick brown fox", "--top", "2"])
    out = capsys.readouterr().out
    assert "tokenizer.json" in out and not re.search(r"after\s+b'", out)  # not byte literals
    lines = [x for x in out.splitlines() if x.startswith("  after")]
    assert lines[0].split("->")[0].strip() == "after      '<s>'"  # BOS first, as the tokenizer config says
    assert any("' the'" in x or "' quick'" in x for x in lines), lines  # BPE pieces, not bytes


def test_generate_chats_with_the_template_and_stops_at_the_end_of_turn(monkeypatch, capsys):
    recipe = _recipe("generate")
    from zoo import data as zdata

    rendered = []
    render = zdata.ChatEncoder.render
    monkeypatch.setattr(zdata.ChatEncoder, "render", lambda self, m, **kw: rendered.append([dict(x) for x in m]) or render(self, m, **kw))
    encoder = zdata.ChatEncoder(zdata.load_tokenizer(TINY))
    assert recipe.end_of_turn(encoder, zdata.load_tokenizer(TINY)) == {4}  # <|im_end|>
    out = recipe.main([str(TINY), "--chat", "What is a list?", "--system", "Be brief.", "--max-new-tokens", "4"])
    assert len(out["answers"]) == 1
    assert rendered[-1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    answers = iter(["first question", "second question", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    out = recipe.main([str(TINY), "--chat", "--max-new-tokens", "3"])
    assert len(out["answers"]) == 2
    assert [m["role"] for m in rendered[-1]] == ["user", "assistant", "user"]  # the conversation is kept
    assert rendered[-1][1]["content"] == out["answers"][0]
    with pytest.raises(SystemExit):
        recipe.main([str(FIXTURES / "llama3_1-tiny"), "--chat", "hi"])
    assert "--chat: chat data needs a chat template" in capsys.readouterr().err


def test_token_counts_and_the_data_description_say_what_they_are():
    from zoo.train.setup import count

    assert count(3259, "train tokens") == "3,259 train tokens"
    assert count(1_234_567, "train tokens") == "1.2M train tokens"
    from zoo.data import load_tokenizer

    assert (
        "EOS 2 after each text and completion; chats end as their template renders them"
        in load_tokenizer(TINY).describe()
    )


def test_the_readme_states_parity_as_measured():
    text = (ROOT / "README.md").read_text()
    claim = re.search(r"parity against\s+`transformers`(.{0,300})", text, re.DOTALL)
    assert claim and "relative" in claim[1] and "absolute" in claim[1], (
        "the README's parity claim names neither measure"
    )


def test_each_model_and_preset_gets_its_own_run_dir_by_default():
    recipe = _recipe("train")
    assert recipe.parse_args([]).run_dir == str(Path("runs") / "llama-small")
    assert recipe.parse_args(["--model", "deepseek_v3", "--preset", "tiny"]).run_dir == str(Path("runs") / "deepseek_v3-tiny")
    assert recipe.parse_args(["--checkpoint", str(TINY)]).run_dir == str(Path("runs") / "tokenizer-tiny")
    assert recipe.parse_args(["--run-dir", "x"]).run_dir == "x"


def test_a_run_dir_holding_a_run_names_run_dir_first(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 1.0}) + "\n")  # a run that trained
    with pytest.raises(ztrain.RunDirError, match=r"choose another one with --run-dir, continue that run with --resume"):
        ztrain.check_run_dir(tmp_path)


def test_eval_and_generate_take_a_training_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    _recipe("train").main(["--preset", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "48", "--eval-every", "2",
                           "--run-dir", str(run), "--peak-tflops", "1"])  # fmt: skip
    assert json.loads((run / "run.json").read_text())["train"]["seq_len"] == 48
    model, step, settings = ztrain.load_run(run)
    assert step == 2 and settings["model"] == "Llama" and model.config == preset("tiny")
    assert "default: a run directory's own --seq-len, else 512" in " ".join(_recipe("eval").parser().format_help().split())
    capsys.readouterr()
    result = _recipe("eval").main([str(run), "--max-rows", "4", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert result["seq_len"] == 48 and "training run, its checkpoint of step 2" in out and "evaluating 4 rows" in out
    out = _recipe("generate").main([str(run), "--max-new-tokens", "3", "--prompt", "def "])
    assert len(out["tokens"][0]) == 3


def test_a_run_trained_on_eight_devices_reads_on_one_as_it_was_trained(tmp_path):
    """A run dir is read onto the reader's devices (a checkpoint saved from 8 is not "damaged" on
    1), and rebuilt as trained: DeepSeek-V3's presets train the MTP module, and it is read too."""
    run = tmp_path / "run"
    _recipe("train").main(["--model", "deepseek_v3", "--preset", "tiny", "--steps", "2", "--batch-size", "8",
                           "--seq-len", "32", "--checkpoint-every", "2", "--mesh", "fsdp=8", "--run-dir", str(run)])  # fmt: skip
    model, step, _ = ztrain.load_run(run)
    assert step == 2 and model.config.mtp and model.mtp is not None
    total = lambda m: float(
        sum(np.abs(np.asarray(x, np.float64)).sum() for x in jax.tree.leaves(eqx.filter(m, eqx.is_array)))
    )
    script = (
        "import sys, jax, numpy as np, equinox as eqx\n"
        "jax.config.update('jax_num_cpu_devices', 1)\n"
        "from zoo import train\n"
        "m, step, _ = train.load_run(sys.argv[1])\n"
        "assert len(jax.devices()) == 1 and step == 2 and m.mtp is not None\n"
        "print(sum(float(np.abs(np.asarray(x, np.float64)).sum()) for x in jax.tree.leaves(eqx.filter(m, eqx.is_array))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) == total(model)


def test_the_loss_plot_and_console_label_each_loss():
    from zoo.train.metrics import curve_labels

    llama = [{"step": 1, "loss": 2.0, "lm_loss": 2.0}, {"step": 2, "val_loss": 2.1}]
    deepseek = [{"step": 1, "loss": 2.4, "lm_loss": 2.0}, {"step": 2, "val_loss": 2.1}]
    assert curve_labels(llama) == ("train next-token loss", None, "validation next-token loss")
    assert (
        curve_labels(deepseek)[0].startswith("train objective") and curve_labels(deepseek)[1] == "train next-token loss"
    )


def test_the_matmul_peak_is_the_best_of_many_runs(monkeypatch):
    """A loaded machine's first runs are slow: five of them made MFU swing by 10-25%."""
    from zoo.train import metrics

    clock = iter(np.cumsum([0.0] + [1.0, 1.0] * 10 + [1.0, 0.25] + [1.0, 1.0] * 200).tolist())
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    n = 64
    assert metrics.matmul_peak_flops(n=n) == pytest.approx(2 * n**3 / 0.25)


def test_the_docs_match_the_dependencies():
    assert "pip install tokenizers" not in (ROOT / "docs" / "generation.md").read_text()
    assert "pip install tokenizers" not in (ROOT / "recipes" / "generate.py").read_text()
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") : readme.index("## Using it")]
    assert "before zoo kept" not in quick and "runs/latest" not in quick
    assert "instead of 19" not in (ROOT / "pyproject.toml").read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_the_readmes_fine_tuning_and_sft_lines_lower_the_held_out_loss(kind, tmp_path):
    """`recipes/train.py --checkpoint DIR --data ...` with the defaults (the README's lines), on
    the tiny BPE checkpoint: the held-out loss falls."""
    import inspect

    docs = [inspect.getdoc(f) or "" for f in (zoo.from_pretrained, zoo.save_pretrained, ztrain.train, ztrain.make_train_step)]
    if kind == "text":
        records = [{"text": d} for d in docs for _ in range(6)]
    else:
        records = [{"messages": [{"role": "user", "content": f"explain {i}"}, {"role": "assistant", "content": d}]}
                   for i, d in enumerate(docs * 6)]  # fmt: skip
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    _recipe("train").main(["--checkpoint", str(TINY), "--data", str(data), "--data-cache", str(tmp_path / "c"), "--steps",
                           "30", "--batch-size", "4", "--seq-len", "64", "--eval-every", "30", "--run-dir",
                           str(tmp_path / "run"), "--save-hf", str(tmp_path / "tuned"), "--peak-tflops", "1"])  # fmt: skip
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert vals[-1] < vals[0], vals
    assert (tmp_path / "tuned" / "tokenizer.json").is_file()
