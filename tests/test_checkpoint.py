"""Hugging Face checkpoint directories: round trips, sharding, FP8 blocks, atomic writes, clear errors."""

import json
import logging
import os
import shutil
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import FIXTURES
from safetensors.numpy import load_file, save_file

import zoo
from zoo.hf import atomic, load, save
from zoo.hf import safetensors as st
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


def test_save_into_a_checkpoint_keeps_its_other_files(tmp_path):
    """A save replaces the model's own files and keeps the tokenizer, README and subfolders beside them."""
    model = zoo.from_pretrained(LLAMA)
    out = tmp_path / "out"
    zoo.save_pretrained(model, out, max_shard_bytes=40_000)
    old_shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert old_shards
    keep = {"tokenizer.json": b'{"a": 1}', "README.md": b"# tiny\n", "eval/x.json": b"[1]", "eval/deep/x.bin": b"\0\1"}
    for name, data in keep.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    (out / "tokenizer.model").symlink_to("tokenizer.json")
    zoo.save_pretrained(model, out)
    for name, data in keep.items():
        assert (out / name).read_bytes() == data, name
    assert (out / "tokenizer.model").is_symlink() and (out / "tokenizer.model").read_bytes() == keep["tokenizer.json"]
    assert not [p for p in out.iterdir() if p.name in old_shards or p.name == "model.safetensors.index.json"]
    assert (out / "model.safetensors").exists()
    _same_arrays(model, zoo.from_pretrained(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_keeps_the_generation_settings(tmp_path):
    """A generation_config.json's sampling settings (Llama 3.1's do_sample, temperature 0.6,
    top_p 0.9) survive a save over the checkpoint, and a save elsewhere can carry them
    (``generation_config=``); the token ids are the saved model's config's."""
    model = zoo.from_pretrained(LLAMA)
    out = tmp_path / "out"
    zoo.save_pretrained(model, out)
    settings = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "bos_token_id": 999, "transformers_version": "4.43.0"}
    (out / "generation_config.json").write_text(json.dumps(settings))
    zoo.save_pretrained(model, out)
    cfg = json.loads((out / "config.json").read_text())
    expected = {**settings, "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    assert json.loads((out / "generation_config.json").read_text()) == expected
    zoo.save_pretrained(model, tmp_path / "other", generation_config=settings)
    assert json.loads((tmp_path / "other" / "generation_config.json").read_text()) == expected
    (out / "generation_config.json").write_text("[not an object")
    with pytest.raises(zoo.CheckpointError, match=r"out/generation_config.json: not a JSON object"):
        zoo.save_pretrained(model, out)


def test_save_refuses_to_replace_a_file(tmp_path):
    model = zoo.from_pretrained(LLAMA)
    (tmp_path / "out").write_text("mine")
    with pytest.raises(zoo.CheckpointError, match="out: exists and is not a directory"):
        zoo.save_pretrained(model, tmp_path / "out")
    assert (tmp_path / "out").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_interrupted_save_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    model = zoo.from_pretrained(LLAMA)
    out = tmp_path / "out"
    zoo.save_pretrained(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = {"n": 0}
    real = save.write_safetensors

    def failing(path, tensors, metadata=None, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated kill mid-save")
        return real(path, tensors, metadata, **kw)

    monkeypatch.setattr(save, "write_safetensors", failing)
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
    out = load._block_dequantize(w, scale, (32, 32), "w", LLAMA)
    for i in range(70):
        for j in range(45):
            assert out[i, j] == np.float32(w[i, j]) * scale[i // 32, j // 32]
    with pytest.raises(zoo.CheckpointError, match=r"w_scale_inv has shape \(2, 2\), expected \(3, 2\)"):
        load._block_dequantize(w, scale[:2], (32, 32), "w", LLAMA)


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


# -- safetensors files are checked against what the format promises -------------------------


def _raw(path, header, data_bytes=0, *, length=None):
    """A safetensors file written byte by byte: ``header`` is a dict or raw header bytes, then zeros."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + b"\0" * data_bytes)
    return path


def _t(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# case: (header, bytes of data after it, header length if not the real one, the error's text after the file)
MALFORMED = {
    "huge header length": (b"{}", 0, 2**62, r"safetensors header length 4611686018427387904 is above the format's cap"),
    "header past the end": (b"{}", 0, 1000, r"truncated safetensors header \(it claims 1000 bytes, 2 follow\)"),
    "not UTF-8": (b'{"\xff": 1}', 0, None, r"safetensors header is not UTF-8 \(byte 2\)"),
    "a JSON list": (b"[1, 2]", 0, None, r"safetensors header is a JSON list, not an object"),
    "entry not an object": ({"w": 5}, 0, None, r"tensor 'w': header entry is 5, not an object"),
    "no offsets": ({"w": {"dtype": "F32", "shape": [1]}}, 4, None, r"tensor 'w': header entry has no 'data_offsets'"),
    "no dtype": ({"w": {"shape": [1], "data_offsets": [0, 4]}}, 4, None, r"tensor 'w': header entry has no 'dtype'"),
    "no shape": ({"w": {"dtype": "F32", "data_offsets": [0, 4]}}, 4, None, r"tensor 'w': header entry has no 'shape'"),
    "unknown dtype": ({"w": _t("Q7", [4], 0, 4)}, 4, None, r"tensor 'w' has unsupported dtype 'Q7'"),
    "bad shape": ({"w": _t("F32", [-1], 0, 4)}, 4, None, r"tensor 'w' has shape \[-1\], not a list"),
    "reversed offsets": ({"w": _t("F32", [0], 4, 0)}, 4, None, r"tensor 'w' has data_offsets \[4, 0\]"),
    "span not shape x dtype": (
        {"w": _t("F32", [2], 0, 4)},
        4,
        None,
        r"tensor 'w' has data_offsets \[0, 4\] \(4 bytes\), but shape \(2,\) of F32 is 8 bytes$",
    ),
    "overlapping spans": (
        {"a": _t("F32", [2], 0, 8), "b": _t("F32", [1], 4, 8)},
        8,
        None,
        r"tensor 'b' bytes \[4, 8\] overlap 'a'",
    ),
    "gap between spans": (
        {"a": _t("F32", [1], 0, 4), "b": _t("F32", [1], 8, 12)},
        12,
        None,
        r"tensor 'b': 4 unused bytes after tensor 'a'",
    ),
    "gap at the start": ({"a": _t("F32", [1], 4, 8)}, 8, None, r"tensor 'a': 4 unused bytes before the first tensor"),
    "span past the end": ({"a": _t("F32", [4], 0, 16)}, 8, None, r"tensor 'a' runs past the end of the file"),
    "bytes after the data": ({"a": _t("F32", [1], 0, 4)}, 12, None, r"8 bytes after the last tensor's data"),
    "metadata not strings": ({"__metadata__": {"format": 1}}, 0, None, r"safetensors __metadata__ must map names to"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_safetensors_is_refused_naming_file_and_tensor(tmp_path, case):
    from safetensors import SafetensorError, safe_open

    header, data_bytes, length, message = MALFORMED[case]
    path = _raw(tmp_path / "model.safetensors", header, data_bytes, length=length)
    with pytest.raises(zoo.CheckpointError, match=f"^{path}: {message}"):
        st.SafetensorsFile(path)
    with pytest.raises(SafetensorError):  # the reference implementation refuses each one too
        safe_open(path, framework="numpy")


def test_header_above_the_cap_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:  # sparse: 150 MB of length-valid zeros, no disk used
        f.write(struct.pack("<Q", 150_000_000))
        f.truncate(8 + 150_000_000 + 16)
    with pytest.raises(zoo.CheckpointError, match=r"big.safetensors: safetensors header length 150000000 is above the"):
        st.SafetensorsFile(path)


def test_malformed_shard_is_named_when_loading(tmp_path):
    d = _copy(tmp_path)
    f = st.SafetensorsFile(d / "model.safetensors")
    header, data = f.header, (d / "model.safetensors").read_bytes()[f._data_start :]
    del f
    first, second = sorted(header, key=lambda k: header[k]["data_offsets"])[:2]
    header[second]["data_offsets"] = [b - 4 for b in header[second]["data_offsets"]]  # over the first's last value
    blob = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    with pytest.raises(zoo.CheckpointError, match=f"model.safetensors: tensor '{second}' bytes .* overlap '{first}'"):
        zoo.from_pretrained(d)


# -- loading refuses what a parameter cannot be, and says what looks wrong ----------------


def _edit_tensors_zoo(d, fn):
    """Like _edit_tensors, through zoo's own reader and writer (the reference numpy loader cannot hold FP8)."""
    f = st.SafetensorsFile(d / "model.safetensors")
    t = {k: np.array(f.get(k)) for k in f.header}
    del f
    fn(t)
    st.write_safetensors(d / "model.safetensors", t.items())


def test_integer_weight_is_refused_naming_key_file_and_dtypes(tmp_path):
    d = _copy(tmp_path)
    _edit_tensors(d, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(
        zoo.CheckpointError,
        match=r"model.safetensors: tensor 'model.norm.weight' is stored as I32, but its parameter is floating point "
        r"\(float32\)",
    ):
        zoo.from_pretrained(d)


def test_integer_fp8_scale_is_refused(tmp_path):
    d = _copy(tmp_path, "deepseek_v3-tiny-fp8")
    key = "model.layers.0.mlp.down_proj.weight_scale_inv"
    _edit_tensors_zoo(d, lambda t: t.update({key: t[key].astype(np.int32)}))
    with pytest.raises(zoo.CheckpointError, match=f"model.safetensors: scale tensor '{key}' is stored as I32"):
        zoo.from_pretrained(d)


def test_non_finite_weights_and_scales_are_reported(tmp_path, caplog):
    d = _copy(tmp_path, "deepseek_v3-tiny-fp8")
    weight, scale = "model.norm.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"

    def poison(t):
        t[weight][[1, 5, 9]] = [np.nan, np.inf, -np.inf]
        t[scale][0, 0] = np.inf

    _edit_tensors_zoo(d, poison)
    with caplog.at_level(logging.WARNING, logger="zoo"):
        zoo.from_pretrained(d)
    messages = [r.getMessage() for r in caplog.records]
    file = d / "model.safetensors"
    assert f"{file}: tensor '{weight}' has 3 non-finite values (NaN or infinite) of 64" in messages
    assert f"{file}: tensor '{scale}' has 1 non-finite values (NaN or infinite) of 8" in messages
    assert len(messages) == 2


# -- saves: the checkpoint's path always exists, leftovers are cleaned, modes follow the umask --


def test_exchange_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    (b / "y").write_text("from b")
    if not atomic._exchange(a, b):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this system")
    assert (a / "y").read_text() == "from b" and (b / "x").read_text() == "from a"
    assert sorted(p.name for p in a.iterdir()) == ["y"] and sorted(p.name for p in b.iterdir()) == ["x"]


def test_save_over_a_checkpoint_never_leaves_its_path_missing(tmp_path, monkeypatch):
    if not atomic._exchange(tmp_path, tmp_path):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this system")
    model = zoo.from_pretrained(LLAMA)
    out = tmp_path / "out"
    zoo.save_pretrained(model, out, max_shard_bytes=40_000)
    seen = []

    def watching(real):
        def call(src, dst, **kw):
            real(src, dst, **kw)
            seen.append(out.is_dir() and any(out.glob("*.safetensors")))

        return call

    monkeypatch.setattr(os, "rename", watching(os.rename))
    monkeypatch.setattr(os, "replace", watching(os.replace))
    zoo.save_pretrained(model, out)
    assert seen and all(seen)
    _same_arrays(model, zoo.from_pretrained(out))


def test_save_without_exchange_falls_back_to_two_renames(tmp_path, monkeypatch):
    model = zoo.from_pretrained(LLAMA)
    out = tmp_path / "out"
    zoo.save_pretrained(model, out, max_shard_bytes=40_000)
    (out / "README.md").write_text("kept")
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    zoo.save_pretrained(model, out)
    files = ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_load_restores_a_checkpoint_a_killed_save_left_as_old(tmp_path, caplog):
    model = zoo.from_pretrained(LLAMA)
    out = tmp_path / "out"
    zoo.save_pretrained(model, out)
    (out / "README.md").write_text("kept")
    out.rename(tmp_path / ".out.old")  # killed between the fallback's two renames
    with caplog.at_level(logging.WARNING, logger="zoo"):
        again = zoo.from_pretrained(out)
    _same_arrays(model, again)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "README.md").read_text() == "kept"
    old = tmp_path / ".out.old"
    assert [r.getMessage() for r in caplog.records] == [
        f"{out}: restored the checkpoint from {old}, where an interrupted save had left it"
    ]


def test_save_removes_temporary_directories_of_killed_saves(tmp_path, caplog):
    model = zoo.from_pretrained(LLAMA)
    out = tmp_path / "out"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / ".out.a1b2c3d4.tmp", tmp_path / f".out.{dead.pid}.e5f6g7h8.tmp", tmp_path / ".out.old"]
    alive = tmp_path / f".out.{os.getppid()}.i9j0k1l2.tmp"  # a save still running in another process
    others = [tmp_path / ".outer.m3n4o5p6.tmp", tmp_path / ".out.notatemp"]
    zoo.save_pretrained(model, out)
    for p in stale + [alive] + others:
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"x" * 1000)
        os.utime(p, (1_000_000_000, 1_000_000_000))
    with caplog.at_level(logging.WARNING, logger="zoo"):
        zoo.save_pretrained(model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", alive.name] + [p.name for p in others])
    messages = sorted(r.getMessage() for r in caplog.records)
    assert messages == sorted(
        [f"{out}: removed {p}, a temporary directory left by an interrupted save" for p in stale[:2]]
        + [f"{out}: removed {stale[2]}, the previous checkpoint left by an interrupted save"]
    )


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_saved_checkpoint_follows_the_umask(tmp_path, mask):
    model = zoo.from_pretrained(LLAMA)
    before = os.umask(mask)
    try:
        zoo.save_pretrained(model, tmp_path / "out", max_shard_bytes=40_000)
    finally:
        os.umask(before)
    out = tmp_path / "out"
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask
    files = list(out.iterdir())
    assert len(files) > 3
    for p in files:
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, p.name


def test_a_save_keeps_every_config_field_it_does_not_model(tmp_path):
    """config.json round trip: fields zoo does not model (pad_token_id, custom keys, the
    transformers version) come back as they were; what it models is written from the model
    (the dtype of the saved weights in both spellings, no quantization for dequantized FP8)."""
    import jax.numpy as jnp

    src = tmp_path / "src"
    shutil.copytree(LLAMA, src)
    raw = json.loads((src / "config.json").read_text())
    raw |= {"pad_token_id": 7, "my_custom": {"a": [1, 2]}, "architectures": ["LlamaForCausalLM"]}
    (src / "config.json").write_text(json.dumps(raw))
    zoo.save_pretrained(zoo.from_pretrained(src), tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: saved.get(k) for k in raw} == raw
    zoo.save_pretrained(zoo.from_pretrained(src, dtype=jnp.bfloat16), tmp_path / "bf16")
    saved = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert saved["dtype"] == saved["torch_dtype"] == "bfloat16" and saved["pad_token_id"] == 7
    zoo.save_pretrained(zoo.from_pretrained(FIXTURES / "deepseek_v3-tiny-fp8"), tmp_path / "fp8")
    saved = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert "quantization_config" not in saved and "pad_token_id" in saved
