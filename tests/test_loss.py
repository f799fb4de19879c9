"""The chunked cross-entropy and the loss's masks: equal to the plain loss, never the full logits."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from families import MODEL_TYPES, tiny, tiny_ids

import zoo
from zoo.layers import unembed
from zoo.loss import chunked_cross_entropy, cross_entropy, next_token_targets


def _problem(b=2, s=13, d=16, v=40, dtype=jnp.float32, seed=0):
    kx, kw, kl, km = jr.split(jr.key(seed), 4)
    x = jr.normal(kx, (b, s, d), dtype)
    w = (0.3 * jr.normal(kw, (v, d))).astype(dtype)
    labels = jr.randint(kl, (b, s), 0, v)
    mask = jr.bernoulli(km, 0.7, (b, s))
    return x, w, labels, mask


@pytest.mark.parametrize("chunk", [1, 5, 13, 26, 64])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_equals_the_plain_loss_and_its_gradients(chunk, masked):
    """Every chunk size (dividing the 26 tokens or not, larger than them): value and both
    gradients equal cross_entropy(unembed(x, w)) to 1e-6."""
    x, w, labels, mask = _problem()
    mask = mask if masked else None

    def plain(x, w):
        return cross_entropy(unembed(x, w), labels, mask)

    def chunked(x, w):
        return chunked_cross_entropy(x, w, labels, mask, chunk_tokens=chunk)

    want, (gx, gw) = jax.value_and_grad(plain, argnums=(0, 1))(x, w)
    got, (cx, cw) = jax.value_and_grad(chunked, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cx), np.asarray(gx), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(cw), np.asarray(gw), rtol=1e-6, atol=1e-7)
    # Without differentiation the loss alone: the same value.
    np.testing.assert_allclose(float(jax.jit(chunked)(x, w)), float(want), rtol=1e-6)


def test_chunked_loss_in_bfloat16_computes_float32_logits():
    x, w, labels, mask = _problem(dtype=jnp.bfloat16)
    got = chunked_cross_entropy(x, w, labels, mask, chunk_tokens=8)
    want = cross_entropy(unembed(x, w), labels, mask)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    g = jax.grad(lambda x: chunked_cross_entropy(x, w, labels, mask, chunk_tokens=8))(x)
    assert g.dtype == jnp.bfloat16


def test_a_frozen_head_gets_no_gradient_and_x_the_plain_one():
    """A head the loss is not differentiated by (LoRA's frozen head): ``x``'s gradient is the
    plain loss's, and the traced gradient pass holds no [V, D] float32 sum (it was computed and
    dropped)."""
    x, w, labels, mask = _problem()

    def frozen(x):
        return chunked_cross_entropy(x, jax.lax.stop_gradient(w), labels, mask, chunk_tokens=8)

    want = jax.grad(lambda x: cross_entropy(unembed(x, w), labels, mask))(x)
    np.testing.assert_allclose(np.asarray(jax.grad(frozen)(x)), np.asarray(want), rtol=1e-6, atol=1e-7)
    text = str(jax.make_jaxpr(jax.grad(frozen))(x))
    assert f"f32[{w.shape[0]},{w.shape[1]}] = broadcast_in_dim" not in text  # the sum's zeros: none


def test_the_gradient_pass_never_holds_the_full_logits():
    """128 tokens and a 4096 vocabulary: the plain loss's temporaries hold [128, 4096] float32
    logits and their gradient (2 MiB each); the chunked loss one 16-token chunk's."""
    x, w, labels, _ = _problem(b=1, s=128, d=32, v=4096)

    def temps(f):
        return jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w).compile().memory_analysis().temp_size_in_bytes

    plain = temps(lambda x, w: cross_entropy(unembed(x, w), labels))
    chunked = temps(lambda x, w: chunked_cross_entropy(x, w, labels, chunk_tokens=16))
    logits_bytes = 128 * 4096 * 4
    assert plain >= 2 * logits_bytes, plain
    assert chunked < logits_bytes // 2, (chunked, plain)


def test_targets_count_only_same_segment_non_padding_masked_predictions():
    ids = jnp.arange(8)[None]
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0]])
    loss_mask = jnp.array([[1, 1, 0, 1, 1, 1, 1, 1]], jnp.bool_)
    labels, mask = next_token_targets(ids, seg)
    np.testing.assert_array_equal(labels, ids[:, 1:])
    np.testing.assert_array_equal(mask, [[1, 1, 0, 1, 0, 0, 0]])  # boundary and padding dropped
    _, mask = next_token_targets(ids, seg, loss_mask)
    np.testing.assert_array_equal(mask, [[1, 0, 0, 1, 0, 0, 0]])  # target 2 is not a target
    _, mask = next_token_targets(ids, None, loss_mask)
    np.testing.assert_array_equal(mask, [[1, 0, 1, 1, 1, 1, 1]])
    _, mask = next_token_targets(ids, seg, shift=2)
    np.testing.assert_array_equal(mask, [[1, 0, 0, 0, 0, 0]])
    # Our check, or the jaxtyping hook's under the test run: either names loss_mask.
    with pytest.raises((ValueError, TypeError), match="loss_mask"):
        next_token_targets(ids, seg, loss_mask[:, :7])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_loss_is_the_token_weighted_mean_of_each_documents_loss(model_type):
    """Two documents packed in a row and padded: lm_loss equals the token-weighted mean of
    each document's own loss (padding never counts), and loss_mask keeps only its targets."""
    model = tiny(model_type)
    ids = tiny_ids(model_type)[:1, :14]
    a, b = ids[:, :9], ids[:, 9:]
    row = jnp.concatenate([ids, jnp.zeros((1, 3), ids.dtype)], axis=1)
    seg = jnp.array([[1] * 9 + [2] * 5 + [0] * 3], jnp.int32)
    pos = jnp.array([list(range(9)) + list(range(5)) + [0, 0, 0]], jnp.int32)
    lm_loss = eqx.filter_jit(zoo.lm_loss)  # compiled: op by op took twice as long
    packed = lm_loss(model, row, positions=pos, segment_ids=seg)
    la, lb = lm_loss(model, a), lm_loss(model, b)
    np.testing.assert_allclose(float(packed), float((8 * la + 4 * lb) / 12), rtol=1e-5)
    # Only document b's predictions: b's own loss.
    only_b = lm_loss(model, row, positions=pos, segment_ids=seg, loss_mask=seg == 2)
    np.testing.assert_allclose(float(only_b), float(lb), rtol=1e-5)
    # The family's training objective takes the same mask.
    total, metrics = eqx.filter_jit(lambda m: m.loss(row, positions=pos, segment_ids=seg, loss_mask=seg == 2))(model)
    np.testing.assert_allclose(float(metrics["lm_loss"]), float(lb), rtol=1e-5)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lm_loss_equals_the_loss_of_the_models_logits(model_type):
    """The chunked training loss equals cross_entropy of model(ids)'s logits (what parity
    tests compare with transformers)."""
    model, ids = tiny(model_type), tiny_ids(model_type)
    want = cross_entropy(model(ids)[:, :-1], ids[:, 1:])
    np.testing.assert_allclose(float(zoo.lm_loss(model, ids)), float(want), rtol=1e-6)


def test_the_train_step_takes_packed_batches():
    """zoo.train's step on a dict batch (ids, segments, positions, loss mask): its loss is
    lm_loss with those fields; a bare id array is the dict holding only input_ids."""
    import equinox as eqx

    from zoo import train as ztrain

    model, ids = tiny("llama"), tiny_ids("llama")
    cfg = ztrain.TrainConfig(steps=2, batch_size=2, seq_len=24, warmup=1)
    tx = ztrain.optimizer(cfg, model)
    step = ztrain.make_train_step(model, cfg, tx)
    seg = jnp.array([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4], jnp.int32)
    t = jnp.arange(24)
    pos = jnp.stack([jnp.where(t < 10, t, t - 10), t])
    mask = jnp.arange(24)[None].repeat(2, 0) % 3 != 0
    fields = {"segment_ids": seg, "positions": pos.astype(jnp.int32), "loss_mask": mask}

    def run(batch):
        params = jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array))  # the step donates them
        return step(params, tx.init(params), jax.tree.map(lambda x: x[None], batch), jnp.int32(0))[2]

    packed = run({"input_ids": ids, **fields})
    np.testing.assert_allclose(float(packed["loss"]), float(zoo.lm_loss(model, ids, **fields)), rtol=1e-5)
    plain = run(ids)
    np.testing.assert_allclose(float(plain["loss"]), float(zoo.lm_loss(model, ids)), rtol=1e-5)
    assert abs(float(plain["loss"]) - float(packed["loss"])) > 1e-3
    with pytest.raises(zoo.ConfigError, match=r"unknown: \['labels'\]"):
        run({"input_ids": ids, "labels": ids})
