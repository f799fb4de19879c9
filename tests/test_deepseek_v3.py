"""DeepSeek-V3 against Hugging Face ``transformers`` on tiny checkpoints in the hub's layout,
and the parts a reference cannot check alone: routing rules, expert paths, MTP, balancing."""

import dataclasses
import json
import logging
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from conftest import FIXTURES, reference
from helpers import check_parity, global_norm
from safetensors.numpy import load_file

import zoo
from zoo.deepseek_v3 import (
    deepseek_v3_loss,
    preset,
    route,
    sequence_balance_loss,
    update_router_bias,
)
from zoo.deepseek_v3.moe import EXPERT_IMPLS
from zoo.layers.grouped_matmul import grouped_matmul
from zoo.hf.safetensors import SafetensorsFile, write_safetensors
from zoo.params import flatten

DS_FIXTURES = sorted(p.name for p in FIXTURES.iterdir() if p.name.startswith("deepseek") and (p / "reference.npz").exists())
TINY = FIXTURES / "deepseek_v3-tiny"


@pytest.mark.parametrize("name", DS_FIXTURES)
def test_parity_with_transformers(name):
    check_parity(FIXTURES / name)


def test_fixtures_cover_the_variants():
    """FP8 blocks, plain query projection + unnormalised top-k, 16 experts / 2 dense layers / MTP."""
    assert {"deepseek_v3-tiny", "deepseek_v3-tiny-fp8", "deepseek_v3-tiny-qplain-unnormed", "deepseek_v3-tiny-16e-mtp"} <= set(
        DS_FIXTURES
    )
    assert json.loads((FIXTURES / "deepseek_v3-tiny-qplain-unnormed" / "config.json").read_text())["q_lora_rank"] is None


def test_router_bias_changes_choice_never_weights():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((16, 8)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(8) * 0.2, jnp.float32)
    kw = dict(top_k=2, n_group=4, topk_group=2, norm_topk_prob=False, scaling=2.5)
    plain, biased = route(x, router, jnp.zeros(8), **kw), route(x, router, bias, **kw)
    changed = np.any(np.sort(plain.experts, -1) != np.sort(biased.experts, -1), axis=-1)
    assert changed.any(), "the bias must change which experts some tokens go to"
    # The weights are always the unbiased scores of the chosen experts, times the scaling.
    expected = 2.5 * np.take_along_axis(np.asarray(biased.scores), np.asarray(biased.experts), -1)
    np.testing.assert_allclose(biased.weights, expected, rtol=1e-6)
    np.testing.assert_array_equal(plain.scores, biased.scores)


def test_group_limit_keeps_experts_inside_the_best_groups():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((128, 16)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((16, 16)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(16) * 0.1, jnp.float32)
    r = route(x, router, bias, top_k=3, n_group=4, topk_group=2, norm_topk_prob=True, scaling=1.0)
    choice = np.asarray(r.scores + bias).reshape(128, 4, 4)
    group_score = np.sort(choice, -1)[..., -2:].sum(-1)
    best_groups = np.argsort(-group_score, -1)[:, :2]
    for t in range(128):
        assert set(np.asarray(r.experts[t]) // 4) <= set(best_groups[t])
    np.testing.assert_allclose(np.asarray(r.weights).sum(-1), 1.0, rtol=1e-6)


def test_fixture_bias_matters():
    """Zeroing the fixture's non-zero correction bias changes the logits (it picks experts)."""
    ref = reference("deepseek_v3-tiny")
    model = zoo.from_pretrained(TINY)
    no_bias = eqx.tree_at(lambda m: m.moe_layers.moe.router_bias, model, jnp.zeros_like(model.moe_layers.moe.router_bias))
    diff = np.abs(np.asarray(no_bias(jnp.asarray(ref["input_ids"]))) - ref["logits"]).max()
    assert diff > 1e-3, diff


def test_router_bias_gets_no_gradient():
    model = zoo.from_pretrained(TINY)
    grads = eqx.filter_jit(eqx.filter_grad(zoo.lm_loss))(model, jnp.asarray(reference("deepseek_v3-tiny")["input_ids"]))
    assert float(jnp.abs(grads.moe_layers.moe.router_bias).max()) == 0.0
    assert float(jnp.abs(grads.moe_layers.moe.router).max()) > 0.0


def _expert_args(seed=0, t=48, d=16, e=8, m=12, k=2):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((d, e)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.2, jnp.float32) for s in [(e, d, m), (e, d, m), (e, m, d)]]
    routing = route(x, router, jnp.zeros(e), top_k=k, n_group=1, topk_group=1, norm_topk_prob=True, scaling=2.5)
    return x, routing, ws


@pytest.mark.parametrize("impl", ["capacity", "grouped", "tiled", "ragged_dot"])
@pytest.mark.parametrize("shape", [dict(), dict(t=37, e=16, m=4, k=4), dict(t=3, e=16, k=3)])
def test_dropless_paths_equal_dense_values_and_gradients(impl, shape):
    """Every dropless path match every-expert-on-every-token, including few tokens (most
    experts empty) and token counts that are not a multiple of anything."""
    x, routing, ws = _expert_args(**shape)
    fast, dense = EXPERT_IMPLS[impl], EXPERT_IMPLS["dense"]

    def loss(fn, x, weights, ws):
        r = routing._replace(weights=weights)
        return jnp.sum(jnp.sin(fn(x, r, *ws)))

    # The float32 bar; measured at most 2e-6 (grouped, ragged_dot) and 3e-6 (tiled) absolute
    # on outputs up to 2.4, over values and all three gradients.
    np.testing.assert_allclose(fast(x, routing, *ws), dense(x, routing, *ws), atol=1e-5, rtol=1e-5)
    for argnum in (1, 2, 3):
        g_f = jax.grad(loss, argnums=argnum)(fast, x, routing.weights, ws)
        g_d = jax.grad(loss, argnums=argnum)(dense, x, routing.weights, ws)
        for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(g_d)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


ROUTINGS = {
    "random": lambda rng, p, e: rng.integers(0, e, p),
    "one expert": lambda rng, p, e: np.full(p, 3),
    "others' pairs": lambda rng, p, e: rng.integers(0, e + 1, p),  # id e: another device's expert
    "skewed": lambda rng, p, e: np.minimum(rng.geometric(0.3, p) - 1, e - 1),
}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("capacity", [8, 16, 64])
def test_capacity_kernel_equals_per_pair_reference(routing, capacity):
    """The batched capacity pass plus the overflow loop equal each pair's row through its own
    expert (values and gradients of x and all three weights), whether nothing, some or almost
    everything overflows, with empty experts and pairs that are not this call's (zeros)."""
    from zoo.layers.capacity_mlp import capacity_expert_mlp, capacity_layout

    rng = np.random.default_rng(1)
    t, d, e, m, k = 21, 16, 8, 12, 3
    pe = jnp.asarray(ROUTINGS[routing](rng, t * k, e), jnp.int32)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for s in [(e, d, m), (e, d, m), (e, m, d)]]
    layout = capacity_layout(pe, e, capacity)

    def reference(x, ws):
        wg, wu, wd = (jnp.concatenate([w, jnp.zeros_like(w[:1])])[pe] for w in ws)  # id e: zero expert
        rows = x[jnp.arange(t * k) // k]
        hidden = jax.nn.silu(jnp.einsum("pd,pdm->pm", rows, wg)) * jnp.einsum("pd,pdm->pm", rows, wu)
        return jnp.einsum("pm,pmd->pd", hidden, wd)

    def kernel(x, ws):
        return capacity_expert_mlp(x, *ws, layout, k, 4)

    overflow = int(jnp.sum(layout.over_sizes))
    assert (overflow > 0) == (int(jnp.bincount(pe, length=e + 1)[:e].max()) > capacity)
    np.testing.assert_allclose(jax.jit(kernel)(x, ws), reference(x, ws), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda x, ws: jnp.sum(jnp.sin(f(x, ws)))  # noqa: E731
    got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1)))(x, ws)
    want = jax.grad(loss(reference), argnums=(0, 1))(x, ws)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [4, 16, 128])
def test_grouped_matmul_skips_padding_rows_and_empty_groups(tile):
    """Rows past sum(group_sizes) give zeros and no gradient; empty groups get zero weight
    gradients; values and both gradients equal a per-row einsum."""
    rng = np.random.default_rng(0)
    sizes = np.array([10, 0, 37, 3, 30])  # 80 real rows of 100
    lhs = jnp.asarray(rng.standard_normal((100, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((5, 16, 24)), jnp.float32)
    group = np.repeat(np.arange(5), sizes)

    def reference_matmul(lhs, rhs):
        return jnp.concatenate([jnp.einsum("ri,rio->ro", lhs[:80], rhs[group]), jnp.zeros((20, 24))])

    def grouped(lhs, rhs):
        return grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32), tile)

    out = grouped(lhs, rhs)
    # The float32 bar. Same products summed in another order (per-tile partial sums for
    # d rhs): measured at most 8e-6 absolute on entries up to 15, under 1e-6 relative.
    np.testing.assert_allclose(out, reference_matmul(lhs, rhs), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(out[80:]))
    loss = lambda f: lambda lhs, rhs: jnp.sum(jnp.sin(f(lhs, rhs)))  # noqa: E731
    got = jax.jit(jax.grad(loss(grouped), argnums=(0, 1)))(lhs, rhs)
    want = jax.grad(loss(reference_matmul), argnums=(0, 1))(lhs, rhs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[0][80:])) and not np.any(np.asarray(got[1][1]))


def test_grouped_matmul_names_bad_shapes():
    """Under the test run's jaxtyping hook the annotation names the operand and dimension;
    without it (a user's run), the kernel's own check does."""
    import jaxtyping

    from zoo.layers.grouped_matmul import _check

    lhs, rhs, sizes = jnp.ones((4, 3)), jnp.ones((2, 5, 6)), jnp.ones(2, jnp.int32)
    with pytest.raises(jaxtyping.TypeCheckError, match=r"parameter 'rhs'"):
        grouped_matmul(lhs, rhs, sizes)
    with pytest.raises(ValueError, match=r"lhs width 3 != rhs input width 5"):
        _check(lhs, rhs, sizes, 128)
    with pytest.raises(ValueError, match=r"3 group sizes for 2 groups"):
        _check(jnp.ones((4, 5)), rhs, jnp.ones(3, jnp.int32), 128)
    with pytest.raises(ValueError, match=r"tile must be a positive int, got 0"):
        _check(jnp.ones((4, 5)), rhs, sizes, 0)


def test_dropless_model_equals_dense_model():
    ids = jnp.asarray(reference("deepseek_v3-tiny-16e-mtp")["input_ids"])
    ragged = zoo.from_pretrained(FIXTURES / "deepseek_v3-tiny-16e-mtp")
    assert ragged.expert_impl == "auto"
    dense = ragged.with_expert_impl("dense")
    np.testing.assert_allclose(eqx.filter_jit(ragged)(ids), eqx.filter_jit(dense)(ids), atol=1e-5)
    grad = eqx.filter_jit(eqx.filter_grad(zoo.lm_loss))
    g_r, g_d = grad(ragged, ids), grad(dense, ids)
    for (path, a), b in zip(flatten(g_r).items(), flatten(g_d).values()):
        # Same float32 arithmetic in another order (sorted tiles vs all experts): measured max 1.5e-7.
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5, err_msg=path)


def test_expert_load_counts_every_routed_token():
    ids = jnp.asarray(reference("deepseek_v3-tiny")["input_ids"])
    model = zoo.from_pretrained(TINY)
    out = model.forward(ids)
    cfg = model.config
    assert out.expert_load.shape == (cfg.num_moe_layers, cfg.n_routed_experts)
    np.testing.assert_array_equal(out.expert_load.sum(-1), ids.size * cfg.num_experts_per_tok)


def test_balance_loss_is_one_when_perfectly_balanced_and_higher_otherwise():
    e, k, s = 4, 2, 8
    scores = jnp.full((1, s, e), 0.5)
    balanced = jnp.asarray([[[0, 1], [2, 3]] * (s // 2)], jnp.int32)
    np.testing.assert_allclose(sequence_balance_loss(scores, balanced), 1.0, rtol=1e-6)
    skewed_scores = jnp.asarray(np.tile([0.9, 0.9, 0.1, 0.1], (1, s, 1)), jnp.float32)
    skewed = jnp.zeros((1, s, k), jnp.int32).at[..., 1].set(1)
    assert float(sequence_balance_loss(skewed_scores, skewed)) > 1.5


def test_bias_update_moves_towards_balance():
    bias = jnp.zeros((2, 4))
    load = jnp.asarray([[10, 0, 5, 5], [5, 5, 5, 5]], jnp.int32)
    new = update_router_bias(bias, load, 0.001)
    np.testing.assert_allclose(new, [[-0.001, 0.001, 0, 0], [0, 0, 0, 0]])


def test_mtp_skipped_with_one_log_line_unless_asked(caplog):
    path = FIXTURES / "deepseek_v3-tiny-16e-mtp"
    with caplog.at_level(logging.INFO, logger="zoo"):
        model = zoo.from_pretrained(path)
    assert model.mtp is None
    assert len([r for r in caplog.records if "skipping" in r.getMessage()]) == 1
    with_mtp = zoo.from_pretrained(path, mtp=True)
    ids = jnp.asarray(reference("deepseek_v3-tiny-16e-mtp")["input_ids"])
    out = with_mtp.forward(ids)
    assert out.mtp_logits.shape == out.logits.shape
    # The main model is unchanged by loading MTP.
    np.testing.assert_array_equal(out.logits, model(ids))


def test_mtp_loss_trains():
    model = zoo.from_pretrained(FIXTURES / "deepseek_v3-tiny-16e-mtp", mtp=True)
    ids = jnp.asarray(reference("deepseek_v3-tiny-16e-mtp")["input_ids"])
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        def f(p):
            return deepseek_v3_loss(eqx.combine(p, static), ids, mtp_weight=1.0)

        (total, metrics), g = jax.value_and_grad(f, has_aux=True)(params)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count with floats
            updates, state = opt.update(g, state)
        return optax.apply_updates(params, updates), state, metrics

    first = None
    for _ in range(15):
        params, state, metrics = step(params, state)
        first = metrics.mtp_loss if first is None else first
    assert float(metrics.mtp_loss) < 0.8 * float(first), (first, metrics.mtp_loss)


def test_mtp_round_trip_keeps_the_hub_layout(tmp_path):
    src = FIXTURES / "deepseek_v3-tiny-16e-mtp"
    model = zoo.from_pretrained(src, mtp=True)
    zoo.save_pretrained(model, tmp_path / "out")
    original, written = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert original.keys() == written.keys()
    for k in original:
        np.testing.assert_array_equal(original[k], written[k], err_msg=k)


def test_fp8_loads_to_the_dequantized_weights():
    fp8, ref = zoo.from_pretrained(FIXTURES / "deepseek_v3-tiny-fp8"), reference("deepseek_v3-tiny-fp8")
    np.testing.assert_allclose(fp8(jnp.asarray(ref["input_ids"])), ref["logits"], atol=1e-5)
    bf16 = zoo.from_pretrained(FIXTURES / "deepseek_v3-tiny-fp8", dtype=jnp.bfloat16)
    assert bf16.moe_layers.moe.w_up.dtype == jnp.bfloat16


def _copy(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def test_missing_fp8_scale_is_named(tmp_path):
    d = _copy(tmp_path, "deepseek_v3-tiny-fp8")
    # The reference library's numpy loader cannot hold FP8; zoo's reader and writer can.
    f = SafetensorsFile(d / "model.safetensors")
    items = [(k, np.array(f.get(k))) for k in f.keys() if k != "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    del f
    write_safetensors(d / "model.safetensors", items)
    with pytest.raises(zoo.CheckpointError, match="model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"):
        zoo.from_pretrained(d)


def test_unknown_quantization_method_is_named(tmp_path):
    d = _copy(tmp_path, "deepseek_v3-tiny-fp8")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "awq"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(zoo.ConfigError, match="quant_method 'awq'"):
        zoo.from_pretrained(d)


def test_expert_count_mismatch_is_named(tmp_path):
    d = _copy(tmp_path, "deepseek_v3-tiny")
    cfg = json.loads((d / "config.json").read_text())
    cfg["n_routed_experts"] = 16
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(zoo.CheckpointError, match="stores 8 routed experts .* n_routed_experts=16"):
        zoo.from_pretrained(d)


def test_flops_count_only_activated_experts():
    c = preset("deepseek-v3-671b")
    assert c.num_params() == pytest.approx(671.0e9, rel=0.002)
    # Published: 685B with the MTP module, whose file also holds copies of embedding and head.
    copies = 2 * c.vocab_size * c.hidden_size
    assert preset("deepseek-v3-671b", mtp=True).num_params() + copies == pytest.approx(685e9, rel=0.002)
    # Published: 37B activated parameters per token (embedding included; the lookup costs no FLOPs).
    attn = 3 * c.num_layers * c.num_heads * (c.qk_head_dim + c.v_head_dim) * 4096
    activated = (c.flops_per_token(4096) - attn) / 6 + c.vocab_size * c.hidden_size
    assert activated == pytest.approx(37e9, rel=0.02)
    more_experts = dataclasses.replace(c, n_routed_experts=512, n_group=8)
    assert more_experts.flops_per_token(4096) - c.flops_per_token(4096) == pytest.approx(6 * 58 * 7168 * 256)


def test_bf16_compute_close_to_float32():
    ref = reference("deepseek_v3-tiny")
    model = zoo.from_pretrained(TINY, compute_dtype=jnp.bfloat16)
    ids = jnp.asarray(ref["input_ids"])
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))(model, ids)
    # bf16-sized: bf16 keeps 8 mantissa bits (relative step 2^-8 = 3.9e-3); measured 6e-5 and 6e-3.
    np.testing.assert_allclose(float(loss), float(ref["loss"]), rtol=4e-3)
    np.testing.assert_allclose(global_norm(grads), float(ref["grad_norm"]), rtol=2e-2)
    assert grads.moe_layers.moe.w_up.dtype == jnp.float32


def test_fresh_model_trains_and_scans():
    config = preset("tiny", mtp=True)
    model = zoo.DeepseekV3(config, key=jr.key(0))
    assert model.moe_layers.moe.w_gate.shape == (2, 8, 64, 32)
    ids = jr.randint(jr.key(1), (2, 16), 0, 256)
    (loss, metrics), g = eqx.filter_jit(eqx.filter_value_and_grad(deepseek_v3_loss, has_aux=True))(model, ids)
    assert np.isfinite(float(loss)) and global_norm(g) > 0
    assert float(metrics.mtp_loss) > 0


def test_bad_routing_config_is_named():
    with pytest.raises(zoo.ConfigError, match="num_experts_per_tok"):
        preset("tiny", num_experts_per_tok=5)
    with pytest.raises(zoo.ConfigError, match="n_group"):
        preset("tiny", n_group=3)
