"""Llama 3.1 against Hugging Face ``transformers`` on tiny checkpoints in the hub's layout."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import FIXTURES, reference
from helpers import check_parity, global_norm

import zoo
from zoo.llama import preset

LLAMA_FIXTURES = sorted(p.name for p in FIXTURES.iterdir() if p.name.startswith("llama") and (p / "reference.npz").exists())


@pytest.mark.parametrize("name", LLAMA_FIXTURES)
def test_parity_with_transformers(name):
    check_parity(FIXTURES / name)


def test_fixtures_cover_the_variants():
    """The reference set exercises tied heads, 1 KV head, MHA, the new spelling and shards."""
    assert {"llama3_1-tiny", "llama3_1-tiny-tied-mqa", "llama3_1-tiny-mha-rope-parameters", "llama3_1-tiny-sharded"} <= set(
        LLAMA_FIXTURES
    )


def _model(**overrides):
    config = dataclasses.replace(preset("tiny"), **overrides)
    return zoo.Llama(config, key=jr.key(0))


def test_packed_segments_match_separate_sequences():
    """Two sequences packed in one row give the same logits as each run alone."""
    model = _model(initializer_range=0.2)
    ids = jr.randint(jr.key(1), (1, 20), 0, 256)
    seg = jnp.concatenate([jnp.zeros((1, 12), jnp.int32), jnp.ones((1, 8), jnp.int32)], axis=1)
    pos = jnp.concatenate([jnp.arange(12), jnp.arange(8)])[None].astype(jnp.int32)
    packed = model(ids, positions=pos, segment_ids=seg)
    first = model(ids[:, :12])
    second = model(ids[:, 12:])
    np.testing.assert_allclose(packed[:, :12], first, atol=1e-5)
    np.testing.assert_allclose(packed[:, 12:], second, atol=1e-5)
    # Without segment ids the second sequence would see the first: the test can fail.
    assert np.abs(np.asarray(model(ids, positions=pos)[:, 12:] - second)).max() > 1e-3


def test_packed_loss_skips_boundary():
    model = _model()
    ids = jr.randint(jr.key(2), (2, 16), 0, 256)
    seg = jnp.broadcast_to(1 + (jnp.arange(16) >= 10).astype(jnp.int32), (2, 16))  # 0 would be padding
    pos = jnp.broadcast_to(jnp.where(jnp.arange(16) >= 10, jnp.arange(16) - 10, jnp.arange(16)), (2, 16)).astype(jnp.int32)
    packed = zoo.lm_loss(model, ids, positions=pos, segment_ids=seg)
    a = zoo.lm_loss(model, ids[:, :10])
    b = zoo.lm_loss(model, ids[:, 10:])
    np.testing.assert_allclose(packed, (9 * a + 5 * b) / 14, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_equals_repeated_kv_heads(kv_heads):
    """Grouped-query attention equals full multi-head attention with each KV head repeated."""
    model = _model(num_kv_heads=kv_heads, initializer_range=0.2)
    rep = 4 // kv_heads
    mha = _model(num_kv_heads=4)
    mha = eqx.tree_at(
        lambda m: (m.embed, m.final_norm, m.head, m.layers),
        mha,
        (model.embed, model.final_norm, model.head, model.layers),
    ) if kv_heads == 4 else eqx.tree_at(
        lambda m: (m.embed, m.final_norm, m.head, m.layers.attn.wq, m.layers.attn.wo, m.layers.attn.wk, m.layers.attn.wv,
                   m.layers.mlp, m.layers.attn_norm, m.layers.mlp_norm),
        mha,
        (model.embed, model.final_norm, model.head, model.layers.attn.wq, model.layers.attn.wo,
         jnp.repeat(model.layers.attn.wk, rep, axis=2), jnp.repeat(model.layers.attn.wv, rep, axis=2),
         model.layers.mlp, model.layers.attn_norm, model.layers.mlp_norm),
    )
    ids = jr.randint(jr.key(3), (2, 12), 0, 256)
    np.testing.assert_allclose(model(ids), mha(ids), atol=1e-5)


def test_bf16_compute_close_to_float32():
    ref = reference("llama3_1-tiny")
    model = zoo.from_pretrained(FIXTURES / "llama3_1-tiny", compute_dtype=jnp.bfloat16)
    logits = model(jnp.asarray(ref["input_ids"]))
    assert logits.dtype == jnp.float32
    assert model.embed.dtype == jnp.float32
    err = np.abs(np.asarray(logits) - ref["logits"])
    scale = np.abs(ref["logits"]).max()
    assert err.max() < 0.02 * scale, err.max()  # bf16 has 8 mantissa bits: ~0.4% per op
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))(model, jnp.asarray(ref["input_ids"]))
    # bf16-sized (2^-8 = 3.9e-3 relative per op); measured 1.8e-4 on the loss and 4e-4 on the norm.
    np.testing.assert_allclose(float(loss), float(ref["loss"]), rtol=4e-3)
    # Gradients reach the float32 parameters as float32 (under strict dtype promotion).
    assert grads.layers.attn.wq.dtype == jnp.float32
    np.testing.assert_allclose(global_norm(grads), float(ref["grad_norm"]), rtol=1e-2)


def test_tied_head_is_one_parameter():
    model = _model(tie_word_embeddings=True)
    assert model.head is None
    ids = jr.randint(jr.key(4), (1, 8), 0, 256)
    g = eqx.filter_grad(zoo.lm_loss)(model, ids)
    # The gradient of the shared table sums its use as embedding and as head.
    assert float(jnp.abs(g.embed).sum()) > 0


def test_scan_compile_cost_does_not_grow_with_depth():
    """One layer body in the program whatever the depth: the HLO size is (nearly) constant."""
    sizes = []
    for layers in (2, 16):
        model = _model(num_layers=layers)
        ids = jnp.zeros((1, 8), jnp.int32)
        text = jax.jit(lambda m, x: zoo.lm_loss(m, x)).lower(model, ids).as_text()
        sizes.append(len(text))
    assert sizes[1] < 1.1 * sizes[0], sizes


def test_config_counts():
    c = preset("llama3.1-8b")
    assert abs(c.num_params() - 8.03e9) < 0.01e9
    # 6 * N_matmul plus attention; matmul params exclude the embedding lookup.
    n_matmul = c.num_params() - c.vocab_size * c.hidden_size - (2 * c.num_layers + 1) * c.hidden_size
    expected = 6 * n_matmul + 6 * c.num_layers * c.num_heads * c.head_dim * 4096
    assert c.flops_per_token(4096) == pytest.approx(expected)
    assert preset("llama3.2-1b").num_params() == pytest.approx(1.236e9, rel=1e-3)


def test_unknown_preset_is_named():
    with pytest.raises(zoo.ConfigError, match="nope"):
        preset("nope")


def test_bad_head_config_is_named():
    with pytest.raises(zoo.ConfigError, match="num_kv_heads"):
        dataclasses.replace(preset("tiny"), num_kv_heads=3)
