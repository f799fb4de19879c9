"""causal_attention against a per-head reference: GQA groups, MLA's narrower values, packed segments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.layers import causal_attention


def reference(q, k, v, scale, segment_ids=None):
    """One query head at a time: head h reads key/value head h // R."""
    s, h = q.shape[1], q.shape[2]
    r = h // k.shape[2]
    allowed = jnp.tril(jnp.ones((s, s), bool))[None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
    heads = []
    for i in range(h):
        scores = jnp.einsum("bsd,btd->bst", q[:, :, i], k[:, :, i // r]) * scale
        probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
        heads.append(jnp.einsum("bst,btv->bsv", probs, v[:, :, i // r]))
    return jnp.stack(heads, axis=2)


@pytest.mark.parametrize(
    "groups, repeats, kv_size",
    [(3, 1, 8), (2, 2, 8), (2, 4, 8), (1, 4, 3)],  # MHA, GQA, MQA-like, value narrower than key (MLA)
)
@pytest.mark.parametrize("packed", [False, True])
def test_matches_per_head_reference(groups, repeats, kv_size, packed):
    b, s, d = 2, 9, 8
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, groups * repeats, d))
    k = jax.random.normal(keys[1], (b, s, groups, d))
    v = jax.random.normal(keys[2], (b, s, groups, kv_size))
    seg = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 3, (b, s)), axis=1), jnp.int32) if packed else None

    def loss(fn, q, k, v):
        out = fn(q, k, v, scale=0.3, segment_ids=seg)
        return jnp.sum(out * jnp.cos(out)), out

    (_, out), grads = jax.value_and_grad(lambda *a: loss(causal_attention, *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (_, want), want_grads = jax.value_and_grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert out.shape == (b, s, groups * repeats, kv_size)
    # The parity bar, 1e-5, in float32; measured: outputs within 3e-7, gradients (entries
    # up to ~11) within 2e-6 of the reference.
    np.testing.assert_allclose(out, want, atol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5)
