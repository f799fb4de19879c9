"""Bad input a skeptical user tried gets a clear error naming the culprit, not NaN or a wrap:
token ids outside the vocabulary (model calls and data files), ids of the wrong rank, losses
over fewer than two positions, and config values out of range, for every family."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from families import CASES, MODEL_TYPES, tiny

import zoo
from zoo.data import load_data, token_file


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("bad", [256, 10_000, -1])
def test_token_ids_outside_the_vocabulary_are_named(model_type, bad):
    """Before: an id at or above the vocabulary gave NaN logits (blamed on the loss later) and a
    negative id silently read the top of the table."""
    model = tiny(model_type)
    ids = jnp.array([[1, 2, 3], [4, bad, 6]], jnp.int32)
    with pytest.raises(ValueError, match=rf"input_ids\[1, 1\] = {bad} is outside the vocabulary 0\.\.255"):
        model(ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        zoo.lm_loss(model, ids)


@pytest.mark.parametrize("shape", [(5,), (1, 2, 3)])
def test_ids_of_the_wrong_rank_are_named(shape):
    """Before: ``IndexError: tuple index out of range`` or an einsum error."""
    model = tiny("llama")
    with pytest.raises((ValueError, TypeError), match="input_ids"):  # (TypeError: the test run's jaxtyping hook)
        model(jnp.ones(shape, jnp.int32))


@pytest.mark.parametrize("length", [0, 1])
def test_a_loss_needs_two_positions(length):
    """Before: ``lm_loss`` on one or no position returned NaN (a mean over no terms)."""
    model = tiny("llama")
    with pytest.raises(ValueError, match=rf"at least 2 positions .* got shape \(2, {length}\)"):
        zoo.lm_loss(model, jnp.ones((2, length), jnp.int32))
    with pytest.raises(ValueError, match="at least 2 positions"):
        tiny("qwen3_moe").loss(jnp.ones((2, length), jnp.int32))


@pytest.mark.parametrize(
    "tokens, message",
    [(np.array([1, 2, 2**40, 3], np.uint64), "token id 1099511627776 at position 2"),
     (np.array([5, -2, 3], np.int64), "token id -2 at position 1"),
     (np.array([5, 300, 3], np.int32), "token id 300 at position 1")],
)  # fmt: skip
def test_token_files_are_range_checked_when_loaded(tmp_path, tokens, message):
    """Before: a uint64 id of 2^40 became 0 when batches were cast to int32, and ids past the
    vocabulary trained on garbage."""
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    with pytest.raises(zoo.ConfigError, match=rf"{path}: {message} is outside the model's vocabulary 0\.\.255"):
        token_file(path, 256)
    with pytest.raises(zoo.ConfigError, match="outside the model's vocabulary"):
        load_data(str(path), 256)


def test_byte_data_needs_a_byte_vocabulary(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(200)) * 10)
    assert load_data(str(tmp_path / "a.txt"), 256).vocab_size == 256
    with pytest.raises(zoo.ConfigError, match=r"token id 1\d\d at position \d+ is outside the model's vocabulary 0\.\.99"):
        load_data(str(tmp_path / "a.txt"), 100)


def _with_config(tmp_path, name: str, **changes):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    if "rope_theta" in changes and "rope_parameters" in cfg:
        cfg["rope_parameters"]["rope_theta"] = changes["rope_theta"]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize(
    "changes, message",
    [({"rms_norm_eps": -1}, r"rms_norm_eps must be a positive finite number, got -1"),
     ({"rope_theta": 0}, r"rope theta must be a positive finite number, got 0"),
     ({"max_position_embeddings": -5}, r"max_position_embeddings must be a positive finite number, got -5")],
)  # fmt: skip
def test_config_values_out_of_range_are_named(tmp_path, model_type, changes, message):
    """Before: ``rms_norm_eps`` -1 and ``rope_theta`` 0 loaded and gave NaN logits;
    ``max_position_embeddings`` -5 loaded."""
    folder = _with_config(tmp_path, CASES[model_type], **changes)
    with pytest.raises(zoo.ConfigError, match=rf"{folder / 'config.json'}: .*{message}"):
        zoo.from_pretrained(folder)
