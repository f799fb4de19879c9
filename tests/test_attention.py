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


# -- JAX's Pallas kernels: TPU's splash attention, GPU's Triton flash attention --------------
# Interpreted here (the kernels' own code evaluated with XLA ops), compiled on their backends.


def kernel_operands(b, s, g, r, d, dv, packed):
    keys = jax.random.split(jax.random.key(s), 4)
    q = jax.random.normal(keys[0], (b, s, g * r, d))
    k = jax.random.normal(keys[1], (b, s, g, d))
    v = jax.random.normal(keys[2], (b, s, g, dv))
    seg = None
    if packed:  # arbitrary (not only contiguous) segments: both kernels mask by equality
        seg = jnp.asarray(np.random.default_rng(s).integers(0, 3, (b, s)), jnp.int32)
    return q, k, v, seg, jax.random.normal(keys[3], (b, s, g * r, dv))


def ships_with_this_jax(path: str) -> bool:
    """Whether ``path``'s library kernel is in this JAX (JAX 0.12.1 removed the Triton flash
    attention). Where it is not, asserts that forcing the path refuses, naming it and the module."""
    from zoo.layers import pallas_attention

    if path != "pallas_gpu" or pallas_attention.gpu_kernel_available():
        return True
    q, k, v, _, _ = kernel_operands(1, 128, 1, 1, 32, 32, False)
    for run in (pallas_attention.pallas_gpu_attention, causal_attention):
        kw = {"implementation": "pallas_gpu"} if run is causal_attention else {}
        with pytest.raises(ValueError, match=r"'pallas_gpu' runs jax\.experimental\.pallas\.ops\.gpu\.attention, which jax"):
            run(q, k, v, scale=0.3, **kw)
    return False


@pytest.mark.filterwarnings("ignore:attention .* runs in Pallas's interpreter")
@pytest.mark.parametrize("path", ["splash", "pallas_gpu"])
@pytest.mark.parametrize(
    "s, groups, repeats, kv_size, packed",
    [
        (200, 2, 2, 32, True),  # GQA, packed, S not a multiple of any block (padded)
        (128, 1, 2, 16, False),  # one key/value head, value narrower than key (MLA)
    ],
)
def test_pallas_kernels_match_dense(path, s, groups, repeats, kv_size, packed):
    from zoo.layers import pallas_attention

    if not ships_with_this_jax(path):
        return
    q, k, v, seg, ct = kernel_operands(2 if packed else 1, s, groups, repeats, 32, kv_size, packed)
    kernel = pallas_attention.KERNELS[path]
    kw = {"block_q": 64, "block_backward": 32} if path == "pallas_gpu" else {"block": 128}

    def run(fn, **kw):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, scale=0.3, segment_ids=seg, **kw), q, k, v)
        return out, vjp(ct)

    (out, grads), (want, want_grads) = run(kernel, **kw), run(causal_attention, implementation="xla")
    assert out.shape == want.shape
    # The parity bar, relative to the largest entry; measured: within 1e-6 of it.
    for got, w in zip((out, *grads), (want, *want_grads)):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()))


def test_auto_picks_each_backends_kernel(monkeypatch):
    from zoo.layers import attention

    def on(backend, dtype, seq_len=256, masked=False):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        return attention.resolve_attention("auto", dtype, seq_len, masked)

    # A JAX that ships the Triton kernel (< 0.12.1) first.
    monkeypatch.setattr(attention.pallas_attention, "gpu_kernel_available", lambda: True)
    assert on("tpu", jnp.float32) == on("tpu", jnp.bfloat16, masked=True) == "splash"
    assert on("gpu", jnp.bfloat16) == "cudnn"
    assert on("gpu", jnp.bfloat16, masked=True) == "pallas_gpu"  # packed rows: segment ids, no dense mask
    assert on("gpu", jnp.float32, masked=True) == "xla"  # float32 stays off Triton (TF32 dots)
    assert on("gpu", jnp.float32, 4096, masked=True) == "blockwise"
    assert on("cpu", jnp.float32) == "xla" and on("cpu", jnp.float32, 4096) == "blockwise"
    # A JAX without the Triton kernel (0.12.1 on): packed half-precision rows run blockwise or
    # dense, and forcing the kernel is refused by name.
    monkeypatch.setattr(attention.pallas_attention, "gpu_kernel_available", lambda: False)
    assert on("gpu", jnp.bfloat16, masked=True) == "xla"
    assert on("gpu", jnp.bfloat16, 4096, masked=True) == "blockwise"
    assert on("gpu", jnp.bfloat16) == "cudnn"
    with pytest.raises(ValueError, match="'pallas_gpu' runs .* no longer ships"):
        attention.resolve_attention("pallas_gpu", jnp.bfloat16, 256, True)


def test_pallas_kernels_refuse_context_parallelism(monkeypatch):
    from zoo.layers import attention

    monkeypatch.setattr(attention, "context_size", lambda: 2)
    assert attention.resolve_attention("auto", jnp.float32, 4096, False) == "blockwise"
    for path in ("splash", "pallas_gpu"):
        with pytest.raises(ValueError, match=f"'{path}' does not run under context parallelism"):
            attention.resolve_attention(path, jnp.float32, 4096, False)


@pytest.mark.filterwarnings("ignore:attention .* runs in Pallas's interpreter")
@pytest.mark.parametrize("path, forward_kernel", [("splash", "splash_mha_fwd"), ("pallas_gpu", "mha_forward")])
def test_pallas_kernels_name_their_residuals(path, forward_kernel):
    """A map that keeps "context" and "attn_lse" spares the backward pass a second forward
    kernel; one that keeps nothing reruns it (as for the blockwise path)."""
    import re

    from zoo.layers import pallas_attention

    if not ships_with_this_jax(path):
        return
    q, k, v, seg, _ = kernel_operands(1, 128, 2, 2, 32, 16, True)
    kw = {"block_q": 64, "block_backward": 32} if path == "pallas_gpu" else {"block": 128}

    def f(q):
        return jnp.sum(pallas_attention.KERNELS[path](q, k, v, scale=0.3, segment_ids=seg, **kw) ** 2)

    def forward_kernels(policy) -> int:
        text = str(jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy)))(q))
        return len(re.findall(rf"name={forward_kernel}\w*", text))

    assert forward_kernels(jax.checkpoint_policies.save_only_these_names("context", "attn_lse")) == 1
    assert forward_kernels(jax.checkpoint_policies.nothing_saveable) == 2
