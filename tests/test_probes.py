"""What skeptical probes broke (issue 30), each fixed: nothing lost, nothing silently wrong."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES

import zoo
from zoo import generate as gen
from zoo import train as ztrain
from zoo.hf.safetensors import CheckpointFiles, write_safetensors

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
