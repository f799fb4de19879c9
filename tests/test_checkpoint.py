"""Hugging Face checkpoint directories: round trips, sharding, FP8 blocks, atomic writes, clear errors."""

import json
import shutil

import jax
import numpy as np
import pytest
from conftest import FIXTURES
from safetensors.numpy import load_file, save_file

import zoo
from zoo.hf import pretrained, safetensors as st
from zoo.params import flatten

LLAMA = FIXTURES / "llama3_1-tiny"


def _copy(tmp_path, name="llama3_1-tiny"):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def _same_arrays(a, b):
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


@pytest.mark.parametrize("name", ["llama3_1-tiny", "llama3_1-tiny-tied-mqa"])
def test_round_trip_is_bit_exact_and_in_the_hub_layout(tmp_path, name):
    model = zoo.from_pretrained(FIXTURES / name)
    zoo.save_pretrained(model, tmp_path / "out")
    again = zoo.from_pretrained(tmp_path / "out")
    _same_arrays(model, again)
    # The written file holds exactly the original tensors, readable by the reference library.
    original = load_file(FIXTURES / name / "model.safetensors")
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == written.keys()
    for k in original:
        np.testing.assert_array_equal(original[k], written[k], err_msg=k)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_sharded_save_and_load(tmp_path):
    model = zoo.from_pretrained(LLAMA)
    zoo.save_pretrained(model, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _same_arrays(model, zoo.from_pretrained(tmp_path / "out"))


def test_save_replaces_an_existing_directory_whole(tmp_path):
    model = zoo.from_pretrained(LLAMA)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    zoo.save_pretrained(model, out)
    assert not (out / "stale.txt").exists()
    _same_arrays(model, zoo.from_pretrained(out))


def test_interrupted_save_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    model = zoo.from_pretrained(LLAMA)
    out = tmp_path / "out"
    zoo.save_pretrained(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = {"n": 0}
    real = pretrained.write_safetensors

    def failing(path, tensors, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated kill mid-save")
        return real(path, tensors, metadata)

    monkeypatch.setattr(pretrained, "write_safetensors", failing)
    with pytest.raises(KeyboardInterrupt):
        zoo.save_pretrained(model, out, max_shard_bytes=40_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_reader_matches_reference_library_on_every_dtype(tmp_path):
    import ml_dtypes

    tensors = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "f16": np.ones((3,), np.float16),
        "i64": np.arange(4, dtype=np.int64),
        "u8": np.arange(5, dtype=np.uint8),
        "empty": np.zeros((0, 2), np.float32),
    }
    save_file(tensors, tmp_path / "a.safetensors")
    f = st.SafetensorsFile(tmp_path / "a.safetensors")
    for k, v in tensors.items():
        np.testing.assert_array_equal(f.get(k), v)
    st.write_safetensors(tmp_path / "b.safetensors", [(k, v) for k, v in tensors.items()] + [("bf16", np.ones(2, ml_dtypes.bfloat16))])
    back = load_file(tmp_path / "b.safetensors")
    for k, v in tensors.items():
        np.testing.assert_array_equal(back[k], v)


def test_fp8_block_dequantization_with_partial_tiles():
    import ml_dtypes

    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 45)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2, (3, 2)).astype(np.float32)
    out = pretrained._block_dequantize(w, scale, (32, 32), "w", LLAMA)
    for i in range(70):
        for j in range(45):
            assert out[i, j] == np.float32(w[i, j]) * scale[i // 32, j // 32]
    with pytest.raises(zoo.CheckpointError, match=r"w_scale_inv has shape \(2, 2\), expected \(3, 2\)"):
        pretrained._block_dequantize(w, scale[:2], (32, 32), "w", LLAMA)


# -- errors that name the culprit ---------------------------------------------------------


def test_no_such_directory(tmp_path):
    with pytest.raises(zoo.CheckpointError, match="no such checkpoint directory"):
        zoo.from_pretrained(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(zoo.CheckpointError, match="no config.json"):
        zoo.from_pretrained(tmp_path)


def test_directory_without_weights(tmp_path):
    d = _copy(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(zoo.CheckpointError, match="no model.safetensors"):
        zoo.from_pretrained(d)


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_unknown_model_type(tmp_path):
    d = _copy(tmp_path)
    _edit_config(d, model_type="gpt2")
    with pytest.raises(zoo.ConfigError, match="unknown model_type 'gpt2'"):
        zoo.from_pretrained(d)


def test_missing_config_field(tmp_path):
    d = _copy(tmp_path)
    _edit_config(d, hidden_size=None)
    with pytest.raises(zoo.ConfigError, match="config.json: required field 'hidden_size' is missing"):
        zoo.from_pretrained(d)


def test_config_field_of_wrong_type(tmp_path):
    d = _copy(tmp_path)
    _edit_config(d, num_hidden_layers="2")
    with pytest.raises(zoo.ConfigError, match="field 'num_hidden_layers' must be int, got str"):
        zoo.from_pretrained(d)


def _edit_tensors(d, fn):
    t = load_file(d / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    d = _copy(tmp_path)
    _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(zoo.CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        zoo.from_pretrained(d)


def test_extra_tensor_is_named_with_its_file(tmp_path):
    d = _copy(tmp_path)
    _edit_tensors(d, lambda t: t.update({"model.layers.7.mlp.up_proj.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(zoo.CheckpointError, match=r"model.safetensors: unexpected tensor 'model.layers.7.mlp.up_proj.weight'"):
        zoo.from_pretrained(d)


def test_wrong_shape_names_expected_and_found(tmp_path):
    d = _copy(tmp_path)
    _edit_tensors(d, lambda t: t.update({"model.norm.weight": np.ones(63, np.float32)}))
    with pytest.raises(zoo.CheckpointError, match=r"'model.norm.weight' has shape \(63,\), expected \(64,\)"):
        zoo.from_pretrained(d)


def test_truncated_file(tmp_path):
    d = _copy(tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(zoo.CheckpointError, match="truncated"):
        zoo.from_pretrained(d)


def test_index_naming_a_missing_shard(tmp_path):
    d = _copy(tmp_path, "llama3_1-tiny-sharded")
    next(d.glob("model-00003-*.safetensors")).unlink()
    with pytest.raises(zoo.CheckpointError, match="model-00003-of-00014.safetensors"):
        zoo.from_pretrained(d)


def test_dtype_option_casts_parameters():
    import jax.numpy as jnp

    model = zoo.from_pretrained(LLAMA, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model))
