"""Qwen3 and Qwen3-MoE: parity with ``transformers`` on four fixtures (dense tied, dense YaRN in the
``rope_parameters`` spelling, MoE with ``num_experts``, MoE with interleaved dense layers, sharded,
with ``num_local_experts``), presets with their published sizes, the hub layout in and out, the
layer-kind rule, the Switch balance loss, and errors that name the culprit.

Placement, generation and parallel layouts are covered by the suites shared by every family
(``test_placement.py``, ``test_generate.py``, ``test_parallel.py``)."""

from __future__ import annotations

import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import FIXTURES, reference
from helpers import check_parity
from safetensors.numpy import load_file

import zoo
from zoo.params import flatten
from zoo.qwen3 import Qwen3Config, Qwen3Training, preset, switch_balance_loss
from zoo.qwen3.loss import RouterStats, layer_router_stats
from zoo.qwen3.routing import route

FIXTURE_NAMES = ["qwen3-tiny-tied", "qwen3-tiny-yarn", "qwen3_moe-tiny", "qwen3_moe-tiny-mixed-sharded"]
MIXED = FIXTURES / "qwen3_moe-tiny-mixed-sharded"


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_parity_with_transformers(name):
    check_parity(FIXTURES / name)


def test_fixtures_cover_the_variants():
    configs = {n: zoo.from_pretrained(FIXTURES / n).config for n in FIXTURE_NAMES}
    tied, yarn, moe, mixed = configs.values()
    assert tied.model_type == "qwen3" and tied.tie_word_embeddings and tied.rope.kind == "default"
    assert yarn.rope.kind == "yarn" and yarn.rope.factor == 4.0 and yarn.head_dim * yarn.num_heads != yarn.hidden_size
    assert "rope_parameters" in json.loads((FIXTURES / "qwen3-tiny-yarn" / "config.json").read_text())
    assert moe.model_type == "qwen3_moe" and moe.layer_kinds == ("moe", "moe") and moe.norm_topk_prob
    assert mixed.layer_kinds == ("dense", "moe", "dense", "moe") and not mixed.norm_topk_prob
    raw = json.loads((MIXED / "config.json").read_text())
    assert "num_local_experts" in raw and "num_experts" not in raw  # the newer spelling
    assert "num_experts" in json.loads((FIXTURES / "qwen3_moe-tiny" / "config.json").read_text())
    assert (MIXED / "model.safetensors.index.json").exists()


def test_layer_kinds_follow_transformers_rule():
    """MoE iff not listed in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    c = preset("moe-tiny", num_layers=6, mlp_only_layers=(3,), decoder_sparse_step=2)
    assert c.layer_kinds == ("dense", "moe", "dense", "dense", "dense", "moe")
    assert c.runs == (("dense", 0, 1), ("moe", 0, 1), ("dense", 1, 4), ("moe", 1, 2))
    assert [b.pattern for b in c.blocks] == [("dense",), ("moe",), ("dense",), ("moe",)]  # no repeating pattern
    assert [(b.dense_first, b.moe_first, b.repeats) for b in c.blocks] == [(0, 0, 1), (1, 0, 1), (1, 1, 3), (4, 1, 1)]
    assert c.sizes["Ld"] == 4 and c.sizes["Lm"] == 2
    # Alternating kinds are one scan over (dense, MoE) pairs; all-MoE one scan over the layers.
    alternating = preset("moe-tiny", num_layers=6, mlp_only_layers=(), decoder_sparse_step=2)
    assert [tuple(b) for b in alternating.blocks] == [(("dense", "moe"), 0, 0, 3)]
    assert [tuple(b) for b in preset("moe-tiny", num_layers=4, mlp_only_layers=()).blocks] == [(("moe",), 0, 0, 4)]
    assert preset("tiny").layer_kinds == ("dense", "dense")


def test_interleaved_layers_match_a_layer_by_layer_forward():
    """The scans over runs of one kind give what running the layers in their stored order gives."""
    check_layer_by_layer(preset("moe-tiny", num_layers=5, mlp_only_layers=(0, 3), decoder_sparse_step=1))


def check_layer_by_layer(config):
    from zoo.qwen3.model import cast_layer, qwen3_layer

    model = zoo.Qwen3(config, key=jr.key(3), expert_impl="dense")
    ids = jr.randint(jr.key(4), (2, 12), 0, config.vocab_size, dtype=jnp.int32)
    logits = model(ids)
    x = jnp.take(model.embed, ids, axis=0)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), ids.shape)
    cos, sin = zoo.layers.rope_cos_sin(config.rope, config.head_dim, positions)
    seen = {"dense": 0, "moe": 0}
    for kind in config.layer_kinds:
        stack = model.dense_layers if kind == "dense" else model.moe_layers
        layer = jax.tree.map(lambda w: w[seen[kind]], stack)  # noqa: B023
        x = qwen3_layer(config, cast_layer(layer, jnp.float32), x, cos, sin, None, kind, "dense")[0]
        seen[kind] += 1
    x = zoo.layers.rms_norm(x, model.final_norm, config.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(zoo.layers.unembed(x, model.head)), atol=1e-5)


@pytest.mark.parametrize("kinds", [dict(mlp_only_layers=(), decoder_sparse_step=2), dict(mlp_only_layers=(0, 1))])
def test_alternating_blocks_match_a_layer_by_layer_forward(kinds):
    """The scan over (dense, MoE) repeats, and over a dense prefix then MoE layers, gives what
    running the layers in their stored order gives."""
    check_layer_by_layer(preset("moe-tiny", num_layers=6, **kinds))


@pytest.mark.parametrize(
    "name, total, active",
    [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9), ("qwen3-8b", 8.2e9, None),
     ("qwen3-32b", 32.8e9, None), ("qwen3-0.6b", 0.6e9, None)],
)  # fmt: skip
def test_presets_have_the_published_sizes(name, total, active):
    c = preset(name)
    assert abs(c.num_params() - total) / total < 0.02, (name, c.num_params())
    if active is not None:
        assert abs(c.num_active_params() - active) / active < 0.03, (name, c.num_active_params())
    else:
        assert c.num_active_params() == c.num_params()
    # FLOPs per token count the activated experts only: 6 x the active matmul parameters (the
    # embedding lookup is free, the norms are not matmuls: 0.1% here), plus attention.
    embed, attention = c.vocab_size * c.hidden_size, 6 * c.num_layers * c.num_heads * c.head_dim
    assert 0.999 * 6 * (c.num_active_params() - embed) <= c.flops_per_token(1) <= 6 * c.num_active_params() + attention


@pytest.mark.parametrize("name", ["qwen3-tiny-tied", "qwen3_moe-tiny-mixed-sharded"])
def test_round_trip_is_bit_exact_and_in_the_hub_layout(tmp_path, name):
    model = zoo.from_pretrained(FIXTURES / name)
    zoo.save_pretrained(model, tmp_path / "out", max_shard_bytes=40_000)
    again = zoo.from_pretrained(tmp_path / "out")
    fa, fb = flatten(model), flatten(again)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    original, written = tensors(FIXTURES / name), tensors(tmp_path / "out")
    assert original.keys() == written.keys()  # per-expert keys, dense layers where they were
    for k in original:
        np.testing.assert_array_equal(original[k], written[k], err_msg=k)
    assert again.config == model.config


def _copy(tmp_path, name=MIXED):
    dst = tmp_path / "ckpt"
    shutil.copytree(name, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_layer_kind_mismatch_is_named(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, mlp_only_layers=[0, 1])
    with pytest.raises(zoo.CheckpointError, match=r"layer 1 is stored as a moe MLP but config.json makes it dense"):
        zoo.from_pretrained(folder)


def test_expert_count_mismatch_is_named(tmp_path):
    folder = _copy(tmp_path)
    _edit_config(folder, num_local_experts=4)
    with pytest.raises(zoo.CheckpointError, match=r"layer 1 stores 8 experts .* num_experts=4"):
        zoo.from_pretrained(folder)


@pytest.mark.parametrize(
    "changes, message",
    [({"attention_bias": True}, "attention_bias"), ({"use_sliding_window": True}, "use_sliding_window"),
     ({"hidden_act": "gelu"}, "hidden_act"), ({"mlp_only_layers": [7]}, r"mlp_only_layers: \[7\]"),
     ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds num_experts \(8\)")],
)  # fmt: skip
def test_bad_config_is_named(tmp_path, changes, message):
    folder = _copy(tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(zoo.ConfigError, match=message):
        zoo.from_pretrained(folder)


def test_expert_paths_agree():
    model = zoo.from_pretrained(FIXTURES / "qwen3_moe-tiny")
    ids = jnp.asarray(reference("qwen3_moe-tiny")["input_ids"])
    ref = model.with_expert_impl("dense")(ids)
    for impl in ("capacity", "grouped", "tiled", "ragged_dot"):
        np.testing.assert_allclose(np.asarray(model.with_expert_impl(impl)(ids)), np.asarray(ref), atol=1e-5, err_msg=impl)


def _hf_load_balancing_loss(logits_per_layer: np.ndarray, top_k: int) -> float:
    """``transformers``' ``load_balancing_loss_func`` (no attention mask), in NumPy: the layers'
    router logits concatenated, one product of means over all of them."""
    logits = logits_per_layer.reshape(-1, logits_per_layer.shape[-1]).astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    e = probs.shape[-1]
    chosen = np.argsort(-probs, axis=-1)[:, :top_k]
    mask = np.eye(e)[chosen]  # [N, K, E]
    tokens_per_expert = mask.mean(axis=0)
    router_prob = probs.mean(axis=0)
    return float(np.sum(tokens_per_expert * router_prob[None]) * e)


def test_switch_balance_loss_matches_transformers_formula():
    layers, t, d, e, k = 3, 40, 16, 8, 2
    x = jr.normal(jr.key(0), (layers, t, d))
    routers = jr.normal(jr.key(1), (layers, d, e))
    loads, prob_sum, logits = [], jnp.zeros(e), []
    for i in range(layers):
        routing = route(x[i], routers[i], top_k=k, norm_topk_prob=False)
        load, probs = layer_router_stats(routing, e)
        loads.append(load)
        prob_sum = prob_sum + probs
        logits.append(np.asarray(x[i] @ routers[i]))
    got = float(switch_balance_loss(RouterStats(jnp.stack(loads), prob_sum), k))
    np.testing.assert_allclose(got, _hf_load_balancing_loss(np.stack(logits), k), rtol=1e-5)


def test_training_loss_adds_the_weighted_balance_loss():
    model = zoo.from_pretrained(MIXED)
    ids = jnp.asarray(reference("qwen3_moe-tiny-mixed-sharded")["input_ids"])
    loss = eqx.filter_jit(lambda mdl, options=None: mdl.loss(ids, options=options))  # compiled: op by op took 3x
    total, m = loss(model)
    assert model.config.router_aux_loss_coef == 0.001
    np.testing.assert_allclose(float(m["lm_loss"]), float(reference("qwen3_moe-tiny-mixed-sharded")["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(total), float(m["lm_loss"] + 0.001 * m["balance_loss"]), rtol=1e-6)
    assert m["expert_load"].shape == (2, 8) and int(m["expert_load"].sum()) == 2 * ids.size * 2
    assert float(m["balance_loss"]) >= 1.0 - 1e-6  # E · Σ f·P is at least 1, its balanced value
    heavier, _ = loss(model, Qwen3Training(aux_loss_coef=1.0))
    np.testing.assert_allclose(float(heavier), float(m["lm_loss"] + m["balance_loss"]), rtol=1e-6)
    # The router gets a gradient from the balance term.
    grad = eqx.filter_jit(eqx.filter_grad(lambda mdl, options: mdl.loss(ids, options=options)[0]))
    g, g0 = grad(model, Qwen3Training(aux_loss_coef=1.0)), grad(model, Qwen3Training(aux_loss_coef=0.0))
    assert float(jnp.abs(g.moe_layers.moe.router - g0.moe_layers.moe.router).max()) > 0
    with pytest.raises(TypeError, match="Qwen3 trains with Qwen3Training options"):
        model.loss(ids, options=zoo.deepseek_v3.DeepseekV3Training())


def test_dense_model_has_no_router_terms():
    model = zoo.from_pretrained(FIXTURES / "qwen3-tiny-tied")
    ids = jnp.asarray(reference("qwen3-tiny-tied")["input_ids"])
    total, m = model.loss(ids)
    assert set(m) == {"lm_loss"} and float(total) == float(m["lm_loss"])
    assert model.head is None  # tied: the embedding is the head
    assert model.forward(ids).router is None


def test_config_json_round_trip():
    for name in FIXTURE_NAMES:
        config = zoo.from_pretrained(FIXTURES / name).config
        assert Qwen3Config.from_hf(config.to_hf()) == config, name
