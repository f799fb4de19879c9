"""FP8 matmuls (``zoo.layers.fp8``) against a NumPy reference written from the recipes' papers
(ml_dtypes' FP8 casts): quantization bit for bit, the forward product and both gradients."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from zoo.errors import ConfigError
from zoo.layers import fp8

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def np_quantize(x, dtype, block, power_of_two=False):
    """Block by block, as the recipes define it: scale = amax · (1 / max) (rounded up to 2^k for MX)."""
    fmax = float(ml_dtypes.finfo(dtype).max)
    block = tuple(n if b == 0 else b for b, n in zip(block, x.shape))
    grid = tuple(-(-n // b) for n, b in zip(x.shape, block))
    q = np.zeros(x.shape, dtype)
    scales = np.zeros(grid, np.float32)
    for idx in np.ndindex(*grid):
        sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block))
        blk = x[sl].astype(np.float32)
        amax = np.float32(np.abs(blk).max())
        s = max(amax * np.float32(1 / fmax), np.finfo(np.float32).tiny)  # never subnormal
        if power_of_two and amax > 0:
            m, e = math.frexp(float(s))
            s = np.float32(s if m == 0.5 else 2.0**e)
        s = s if amax > 0 else np.float32(1.0)
        q[sl] = np.clip(blk / s, -fmax, fmax).astype(dtype)
        scales[idx] = s
    return q, scales


def np_fake(x, dtype, block, power_of_two=False):
    q, s = np_quantize(x, dtype, block, power_of_two)
    full = s
    for axis, (b, n) in enumerate(zip(block, x.shape)):
        full = np.repeat(full, n if b == 0 else b, axis=axis).take(np.arange(n), axis=axis)
    return q.astype(np.float32) * full


# (recipe, x's block and format, w's, g's for dx, w's for dx, x's for dw, g's for dw), 2-D operands
NP_RECIPES = {
    "tensorwise": dict(x=((0, 0), E4M3), w=((0, 0), E4M3), g=((0, 0), E5M2), w_t=((0, 0), E4M3),
                       x_t=((0, 0), E4M3), g_t=((0, 0), E5M2)),
    "mxfp8": dict(x=((1, 32), E4M3), w=((32, 1), E4M3), g=((1, 32), E4M3), w_t=((1, 32), E4M3),
                  x_t=((32, 1), E4M3), g_t=((32, 1), E4M3)),
    "blockwise": dict(x=((1, 128), E4M3), w=((128, 128), E4M3), g=((1, 128), E4M3), w_t=((128, 128), E4M3),
                      x_t=((128, 1), E4M3), g_t=((128, 1), E4M3)),
}  # fmt: skip


def _data(shape, seed, spread=True) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:  # magnitudes over six decades, so blocks get different scales
        x *= np.exp(rng.uniform(-7, 7, shape)).astype(np.float32)
    return x


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8", "blockwise"])
@pytest.mark.parametrize("role", ["x", "w", "g", "x_t"])
def test_quantization_matches_numpy_bit_for_bit(recipe, role):
    x = _data((150, 200), 0)  # neither dimension a multiple of 128: partial blocks at the ends
    x[:, 40:72] = 0.0  # an all-zero MX block
    block, dtype = NP_RECIPES[recipe][role]
    q_ref, s_ref = np_quantize(x, dtype, block, recipe == "mxfp8")
    ours_block, ours_dtype = fp8._blocks(recipe, 0)[role]
    assert ours_block == block and jnp.dtype(ours_dtype) == np.dtype(dtype)
    q, s = jax.jit(lambda a: fp8.quantize(a, ours_dtype, ours_block, power_of_two=recipe == "mxfp8"))(x)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
    if recipe == "mxfp8":  # E8M0: every scale a power of two
        assert np.all(np.frexp(np.asarray(s))[0] == 0.5)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8", "blockwise"])
def test_matmul_and_its_gradients_match_numpy(recipe):
    t, k, n = 96, 160, 136
    x, w, g = _data((t, k), 1), _data((k, n), 2, spread=False), _data((t, n), 3)
    r = NP_RECIPES[recipe]
    pow2 = recipe == "mxfp8"

    def fq(a, role):
        return np_fake(a, r[role][1], r[role][0], pow2)

    want_y = fq(x, "x") @ fq(w, "w")
    want_dx = fq(g, "g") @ fq(w, "w_t").T
    want_dw = fq(x, "x_t").T @ fq(g, "g_t")
    @jax.jit
    def value_and_grads(a, b, c):
        y, vjp = jax.vjp(lambda a, b: fp8.fp8_matmul(a, b, recipe), a, b)
        return (y, *vjp(c))

    y, dx, dw = value_and_grads(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    # the same FP8 operands and scales; only float32 summation order differs from NumPy's matmul
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # The quantization error is the recipe's, not zero: FP8 is not float32.
    assert np.abs(np.asarray(y) - x @ w).max() > 1e-4 * np.abs(x @ w).max()


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8", "blockwise"])
def test_einsum_spellings_agree_with_the_matmul(recipe):
    """Multi-letter contractions and expert batches reduce to one [E, T, K] @ [E, K, N] matmul."""
    h = jnp.asarray(_data((2, 5, 4, 32), 4))  # b s h k
    wo = jnp.asarray(_data((4, 32, 48), 5))  # h k d
    einsum, matmul = jax.jit(fp8.einsum_fp8, static_argnums=(0, 3)), jax.jit(fp8.fp8_matmul, static_argnums=2)
    got = einsum("bshk,hkd->bsd", h, wo, recipe)
    want = matmul(h.reshape(10, 128), wo.reshape(128, 48), recipe).reshape(2, 5, 48)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    xe, we = jnp.asarray(_data((3, 7, 64), 6)), jnp.asarray(_data((3, 64, 40), 7))  # experts: e t d, e d m
    got = einsum("etd,edm->etm", xe, we, recipe)
    for e in range(3):  # tensorwise scales per expert; block scales never span experts
        np.testing.assert_array_equal(np.asarray(got[e]), np.asarray(matmul(xe[e], we[e], recipe)))


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_block_recipes_inside_shard_map_are_one_devices_products(recipe):
    """Rows split over a mesh axis (the batch's), 128 a device: each device's blocks are one
    device's (along the rows too, for the weight's gradient: 32 or 128 rows), so every product has
    one device's FP8 operands and scales, and the weight's gradient is summed over the devices.
    Only float32 summation order differs: XLA:CPU blocks a [128, 64] dot otherwise than a
    [1024, 64] one (measured at 32 rows a device: up to 4.4e-4 relative, 0.5 absolute, on elements near zero,
    under 1e-5 of the largest), hence the issue's 1e-5 relative to each tensor's largest value, as
    test_matmul_and_its_gradients_match_numpy.
    MXFP8's CUDA branch (XLA's block-scaled dot, traced on every platform) typed its result as
    varying over no axis, and every MXFP8 step on a mesh failed to trace (a planner run found it)."""
    from jax.sharding import PartitionSpec as P

    from zoo import parallel

    x, w, g = (jnp.asarray(_data(s, i)) for i, s in ((10, (1024, 64)), (11, (64, 32)), (12, (1024, 32))))

    def grads(a, b, c):
        y, vjp = jax.vjp(lambda a, b: fp8.fp8_matmul(a, b, recipe), a, b)
        return (y, *vjp(c))

    mesh = parallel.make_mesh("data=8")
    # w is the same on every device: its gradient comes out summed over them (shard_map's types).
    rows = jax.shard_map(grads, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=(P("data"), P("data"), P()))
    (y, dx, dw), (y1, dx1, dw1) = jax.jit(rows)(x, w, g), jax.jit(grads)(x, w, g)
    for got, want in ((y, y1), (dx, dx1), (dw, dw1)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_matmul_follows_the_active_map_and_refuses_unknown_names():
    x, w = jnp.asarray(_data((4, 64), 8)), jnp.asarray(_data((64, 16), 9))
    plain = fp8.matmul("mlp_up", "td,df->tf", x, w)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(jnp.einsum("td,df->tf", x, w)))
    with fp8.using({"mlp_up": "mxfp8", "mlp_gate": "none"}):
        np.testing.assert_array_equal(
            np.asarray(fp8.matmul("mlp_up", "td,df->tf", x, w)), np.asarray(fp8.fp8_matmul(x, w, "mxfp8"))
        )
        np.testing.assert_array_equal(np.asarray(fp8.matmul("mlp_gate", "td,df->tf", x, w)), np.asarray(plain))
        with pytest.raises(ConfigError, match="names no matmul 'mlp_down'"):
            fp8.matmul("mlp_down", "td,df->tf", x, w)
    with pytest.raises(ConfigError, match="unknown FP8 recipe 'fp4'"), fp8.using({"mlp_up": "fp4"}):
        pass


def test_tensorwise_products_are_fp8_dots_in_the_program():
    """The forward product and both gradients are FP8 x FP8 dots with float32 results (E5M2
    cotangents), so a GPU compiler sees FP8 GEMMs; nothing else in the step is a dot."""
    x, w = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((64, 16), jnp.bfloat16)

    def loss(a, b):
        return fp8.fp8_matmul(a, b, "tensorwise").astype(jnp.float32).sum()

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3, dots
    operands = [line.rsplit(":", 1)[1] for line in dots]
    assert all(o.count("f8E4M3FN") + o.count("f8E5M2") == 2 and "-> tensor<" in o for o in operands), operands
    assert sum("f8E5M2" in o for o in operands) == 2  # the cotangent in both gradient products


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8", "blockwise"])
def test_a_block_of_tiny_values_quantizes_to_finite_numbers(recipe):
    """A block whose largest value is near float32's smallest normal: its scale (amax / 448) would
    be subnormal, which XLA flushes to zero, and 0 / 0 made NaN rows (a bf16 run of the main job
    with --precision blockwise reached NaN gradients at step 34). The scale is kept normal."""
    x = _data((64, 256), 10)
    x[:, :128] = 1.65e-38 * np.sign(x[:, :128])  # the first 128-column tile of every row: tiny values
    block, dtype = NP_RECIPES[recipe]["x"]
    q, s = jax.jit(lambda a: fp8.quantize(a, dtype, block, power_of_two=recipe == "mxfp8"))(x)
    assert np.isfinite(np.asarray(q).astype(np.float32)).all() and np.isfinite(np.asarray(s)).all()
    q_ref, s_ref = np_quantize(x, dtype, block, recipe == "mxfp8")
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
    dx, dw = jax.jit(jax.grad(lambda a, b: fp8.fp8_matmul(a, b, recipe).sum(), argnums=(0, 1)))(
        jnp.asarray(x), jnp.asarray(_data((256, 32), 11, spread=False))
    )
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()


def _np_routed_experts(x, pair_experts, k, ws, recipes, capacity, tile, dout):
    """The routed experts' SwiGLU in FP8 as the capacity kernel defines its scales, in NumPy:
    tensorwise, one scale per expert and tensor over all the expert's rows; block recipes, blocks
    within each group of the expert's rows (pairs in order): the first ``capacity`` (the batched
    pass), then ``tile`` at a time (the overflow tiles). Each pair's output; the gradients of x
    and the weights for the pairs' output cotangent ``dout``."""
    wg, wu, wd = ws
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    out, dpair = (np.zeros((len(pair_experts), x.shape[1]), np.float32) for _ in range(2))
    grads = [np.zeros_like(w) for w in ws]
    for e in range(wg.shape[0]):
        group = np.flatnonzero(pair_experts == e)
        cuts = [0, *range(capacity, len(group), tile), len(group)]

        def fq(a, which, role, cuts=cuts):
            recipe = recipes[which]
            if recipe == "none":
                return a
            block, dtype = NP_RECIPES[recipe][role]
            if recipe == "tensorwise" or role in ("w", "w_t"):
                return np_fake(a, dtype, block, recipe == "mxfp8")
            return np.concatenate([np_fake(a[i:j], dtype, block, recipe == "mxfp8") for i, j in itertools.pairwise(cuts)])

        if len(group):
            xs, g = x[group // k], dout[group]
            gate, up = fq(xs, 0, "x") @ fq(wg[e], 0, "w"), fq(xs, 1, "x") @ fq(wu[e], 1, "w")
            sig = 1 / (1 + np.exp(-gate))
            hidden = silu(gate) * up
            out[group] = fq(hidden, 2, "x") @ fq(wd[e], 2, "w")
            dhidden = fq(g, 2, "g") @ fq(wd[e], 2, "w_t").T
            dgate, dup = dhidden * up * sig * (1 + gate * (1 - sig)), dhidden * silu(gate)
            grads[2][e] += fq(hidden, 2, "x_t").T @ fq(g, 2, "g_t")
            grads[0][e] += fq(xs, 0, "x_t").T @ fq(dgate, 0, "g_t")
            grads[1][e] += fq(xs, 1, "x_t").T @ fq(dup, 1, "g_t")
            dpair[group] = fq(dgate, 0, "g") @ fq(wg[e], 0, "w_t").T + fq(dup, 1, "g") @ fq(wu[e], 1, "w_t").T
    return out, dpair.reshape(x.shape[0], k, -1).sum(1), grads


@pytest.mark.parametrize("recipes", [("tensorwise",) * 3, ("mxfp8",) * 3, ("blockwise",) * 3,
                                     ("tensorwise", "none", "blockwise")])  # fmt: skip
@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "overflow"])
def test_routed_experts_in_fp8_match_numpy_per_expert_group(recipes, skewed):
    """The capacity kernel's routed experts in FP8 (issue 40): the output and every gradient as
    NumPy computes them, tensorwise with one scale per expert and tensor over all its rows (the
    batched pass's and the overflow tiles'), block recipes with blocks inside the batched pass and
    inside each tile. With most pairs routed to one expert, most of its rows go through the
    overflow tiles (two, one partial), and its largest rows are there."""
    from zoo.layers.capacity_mlp import capacity_expert_mlp, capacity_for, capacity_layout

    t, k, e, d, m = 64, 2, 4, 48, 40
    rng = np.random.default_rng(7)
    pair_experts = (rng.permutation(t * k) % e if not skewed else np.where(rng.random(t * k) < 0.6, 0, rng.integers(1, e, t * k)))
    x, dout = _data((t, d), 8, spread=False), _data((t * k, d), 9)
    if skewed:  # the largest rows among the overflow's: its scales must come from those rows
        late = np.flatnonzero(pair_experts == 0)[-8:]
        x[late // k] *= 4
        dout[late] *= 4
    ws = [_data(s, 10 + i, spread=False) * 0.2 for i, s in enumerate([(e, d, m), (e, d, m), (e, m, d)])]
    c, tile = capacity_for(t * k, e), 32
    want_out, want_dx, want_dw = _np_routed_experts(x, pair_experts, k, ws, recipes, c, tile, dout)

    @jax.jit
    def run(x, ws, pair_experts, dout):
        layout = capacity_layout(pair_experts.astype(jnp.int32), e, c)
        y, vjp = jax.vjp(lambda x, ws: capacity_expert_mlp(x, *ws, layout, k, tile, recipes), x, ws)
        return y, *vjp(dout)

    out, dx, dws = run(jnp.asarray(x), [jnp.asarray(w) for w in ws], jnp.asarray(pair_experts), jnp.asarray(dout))
    if skewed:
        assert (pair_experts == 0).sum() > c + tile  # the overflow runs, over more than one tile
    for got, want in ((out, want_out), (dx, want_dx), *zip(dws, want_dw)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = _np_routed_experts(x, pair_experts, k, ws, ("none",) * 3, c, tile, dout)[0]
    assert np.abs(np.asarray(out) - exact).max() > 1e-4 * np.abs(exact).max()  # FP8 is not float32
