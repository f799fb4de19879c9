"""zoo.lora.nf4: QLoRA's NF4 base against bitsandbytes (tests/fixtures/nf4, written by
bitsandbytes 0.50.2: make_nf4_fixtures.py), and LoRA on it against LoRA on its dequantized
weights."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import FIXTURES
from helpers import load_recipe

import zoo
from zoo import lora
from zoo.core.registry import family_of
from zoo.errors import CheckpointError, ConfigError
from zoo.hf.safetensors import SafetensorsFile
from zoo.lora import fp8, int8, nf4
from zoo.lora.quantized import QuantizedWeight
from zoo.params import flatten

BNB = np.load(FIXTURES / "nf4" / "bitsandbytes.npz")
BNB_INT8 = np.load(FIXTURES / "int8" / "bitsandbytes.npz")
WEIGHTS = range(3)


def test_tables_are_bitsandbytes():
    np.testing.assert_array_equal(nf4.NF4, BNB["nf4"])
    np.testing.assert_array_equal(nf4.dynamic_map(), BNB["code2"])  # create_dynamic_map(signed=True), float32


@pytest.mark.parametrize("i", WEIGHTS)
def test_dequantization_is_bitsandbytes_bit_for_bit(i):
    """bitsandbytes' quantized weight dequantized here: its float32 values exactly."""
    out = nf4.dequantize(*(jnp.asarray(BNB[k]) for k in (f"packed{i}", f"absmax{i}", f"absmax2_{i}", f"offset{i}")))
    np.testing.assert_array_equal(np.asarray(out).reshape(BNB[f"w{i}"].shape), BNB[f"out{i}"])


@pytest.mark.parametrize("i", WEIGHTS)
def test_int8_is_bitsandbytes_bit_for_bit(i):
    """Row-wise int8 (LLM.int8's weights): bitsandbytes' codes and row absmax from the same
    float32 weight (ties rounded to even, weight 2's last row), and its dequantized values."""
    q = int8.quantize(BNB_INT8[f"w{i}"])
    np.testing.assert_array_equal(q["codes"], BNB_INT8[f"codes{i}"])
    np.testing.assert_array_equal(q["stats"], BNB_INT8[f"stats{i}"])
    out = int8.dequantize(jnp.asarray(BNB_INT8[f"codes{i}"]), jnp.asarray(BNB_INT8[f"stats{i}"]))
    np.testing.assert_array_equal(np.asarray(out).reshape(BNB_INT8[f"w{i}"].shape), BNB_INT8[f"out{i}"])


@pytest.mark.parametrize("i", WEIGHTS)
def test_quantization_is_bitsandbytes(i):
    """The 4-bit codes, the absmax's offset and second-level scales are bitsandbytes' exactly;
    each absmax's 8-bit code is the nearest level of the dynamic map, bitsandbytes' wherever its
    CPU kernel's is the nearest too (in w1 one of 640 is not: 0.0578024 coded 0.0592188, not
    0.0564063)."""
    q = nf4.quantize(BNB[f"w{i}"])
    np.testing.assert_array_equal(q["packed"], BNB[f"packed{i}"])
    np.testing.assert_array_equal(q["absmax2"], BNB[f"absmax2_{i}"])
    assert q["offset"] == BNB[f"offset{i}"]
    x = np.abs(BNB[f"w{i}"].reshape(-1, nf4.BLOCK)).max(axis=1) - q["offset"]
    normed = x / np.repeat(q["absmax2"], nf4.STATS_BLOCK)[: len(x)]
    code = nf4.dynamic_map()
    ours, theirs = (np.abs(normed - code[c.astype(int)]) for c in (q["absmax"], BNB[f"absmax{i}"]))
    assert np.all(ours <= np.abs(normed[:, None] - code[None, :]).min(axis=1) + 1e-7)  # the nearest
    differ = q["absmax"] != BNB[f"absmax{i}"]
    assert np.all(ours[differ] < theirs[differ]) and differ.sum() <= (1 if i == 1 else 0)


def test_a_weight_not_in_whole_blocks_is_refused():
    with pytest.raises(ConfigError, match="layers.attn.wq.*block of 64"):
        nf4.quantize(np.zeros((3, 7), np.float32), "layers.attn.wq")


# Each family once with a block-scaled format (DeepSeek-V3 with int8; NF4 on DeepSeek-V3 was dropped for
# the suite's time: the NF4 path is the same per-layer dequantization, checked on Llama and Qwen3-MoE).
@pytest.mark.parametrize("name, fmt", [("llama3_1-tiny", nf4), ("qwen3_moe-tiny", nf4), ("llama3_1-tiny", int8),
                                       ("deepseek_v3-tiny", int8), ("llama3_1-tiny", fp8)])  # fmt: skip
def test_lora_on_a_quantized_base_is_lora_on_its_dequantized_weights(name, fmt):
    """Every linear weight of the layer stacks in NF4, int8 or FP8 (about a quarter of float32's
    bytes with their scales, NF4 a little less at real sizes): the model runs its dequantized
    weights, a layer at a time; LoRA on it has the loss and adapter gradients of LoRA on those
    weights, and merges into the same checkpoint."""
    base = zoo.from_pretrained(FIXTURES / name)
    quantized = fmt.quantize_model(base)
    plain = fmt.dequantized(quantized)
    ids = jnp.arange(32).reshape(2, 16) % base.config.vocab_size
    np.testing.assert_allclose(np.asarray(quantized(ids)), np.asarray(plain(ids)), atol=1e-5, rtol=0)
    assert float(jnp.abs(quantized(ids) - base(ids)).max()) > 1e-2  # quantizing changed the weights
    held = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731
    stacks = [x for x in jax.tree.leaves(quantized, is_leaf=held) if held(x)]
    assert stacks and fmt.nbytes(stacks) < 0.3 * sum(x.stacked_value().nbytes for x in stacks)

    model = lora.init(quantized, lora.LoraConfig(r=4, alpha=8, targets=("all-linear",)), key=jr.key(1))
    model = eqx.tree_at(lambda m: m.adapters, model, jax.tree.map(lambda x: x + 0.01, model.adapters))  # B != 0
    ref = lora.LoraModel(base=plain, adapters=model.adapters, lora=model.lora)

    def grads(m):
        return eqx.filter_value_and_grad(lambda a: eqx.tree_at(lambda x: x.adapters, m, a).loss(ids)[0])(m.adapters)

    (loss, g), (ref_loss, ref_g) = grads(model), grads(ref)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for path in ref_g:
        for x, y in ((g[path].a, ref_g[path].a), (g[path].b, ref_g[path].b)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5 * float(np.abs(np.asarray(y)).max()), err_msg=path)
    np.testing.assert_array_equal(np.asarray(lora.merge(model)(ids)), np.asarray(lora.merge(ref)(ids)))


@pytest.mark.parametrize("name, fmt", [("llama3_1-tiny", nf4), ("deepseek_v3-tiny", int8), ("llama3_1-tiny", fp8)])
def test_a_checkpoint_loads_quantized_as_read(name, fmt):
    """``nf4.from_pretrained`` / ``int8.from_pretrained`` quantize each layer stack's weights on
    the host as the checkpoint is read (the device never holds them unquantized): the model is
    the loaded model quantized, leaf for leaf; a mesh is refused by name."""
    loaded = fmt.from_pretrained(FIXTURES / name)
    want = fmt.quantize_model(zoo.from_pretrained(FIXTURES / name))
    assert jax.tree.structure(loaded) == jax.tree.structure(want)
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(want), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(TypeError, match="convert= is for one device"):
        fmt.from_pretrained(FIXTURES / name, mesh=jax.make_mesh((1,), ("data",)))


def test_an_fp8_checkpoint_is_kept_in_its_own_codes():
    """Issue 41's FP8 base: ``fp8.from_pretrained`` on DeepSeek-V3's FP8 layout keeps each weight's
    stored E4M3 codes and ``weight_scale_inv`` as they are (not re-quantized; the router stays in the
    float32 the checkpoint stores it in); its dequantized weights are ``zoo.from_pretrained``'s,
    bit for bit; and :func:`fp8.quantize` of those weights gives back the codes and scales of the
    quantizer that wrote the fixture (upstream, not zoo's)."""
    directory = FIXTURES / "deepseek_v3-tiny-fp8"
    loaded = fp8.from_pretrained(directory)
    plain = zoo.from_pretrained(directory)
    got, want = flatten(fp8.dequantized(loaded)), flatten(plain)
    assert set(got) == set(want)
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]), err_msg=path)
    assert isinstance(loaded.moe_layers.moe.router, jax.Array)  # stored float32: kept so
    files = SafetensorsFile(directory / "model.safetensors")
    specs, sizes = family_of(plain).param_specs(plain.config), plain.config.sizes
    weights = {"moe_layers.moe.w_gate": loaded.moe_layers.moe.w_gate, "dense_layers.attn.wq_b": loaded.dense_layers.attn.wq_b}
    for path, w in weights.items():
        assert isinstance(w, fp8.FP8Weight) and w.block == (32, 32), path
        for idx, key in specs[path].hf_keys(sizes):
            codes, scale = files.get(key), files.get(f"{key}_scale_inv")
            np.testing.assert_array_equal(np.asarray(w.codes[idx]).view(np.uint8), codes.view(np.uint8), err_msg=key)
            np.testing.assert_array_equal(np.asarray(w.scale_inv[idx]), scale, err_msg=key)
    again = fp8.quantize_model(plain, block=(32, 32))  # the dequantized weights quantized by zoo
    assert jax.tree.structure(again) == jax.tree.structure(loaded)
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(loaded), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    ids = jnp.arange(32).reshape(2, 16) % plain.config.vocab_size
    np.testing.assert_allclose(np.asarray(loaded(ids)), np.asarray(plain(ids)), atol=1e-5, rtol=0)
    assert fp8.nbytes(weights["moe_layers.moe.w_gate"]) < 0.26 * weights["moe_layers.moe.w_gate"].stacked_value().nbytes


def test_zoo_train_trains_lora_on_an_nf4_base_as_on_its_dequantized_weights(tmp_path):
    """QLoRA through zoo.train (it was refused: the run state held floating arrays only): the
    run carries the NF4 codes unchanged, keeps moments for the adapters only, resumes (with the
    base on host) as if uninterrupted, and trains the adapters as LoRA on the dequantized
    weights does. A model with NF4 weights and no adapters is refused, naming what to do."""
    from zoo import train as ztrain
    from zoo.core.params import run_state
    from zoo.data import stdlib_corpus
    from zoo.llama import preset

    corpus = stdlib_corpus(max_bytes=2**20)
    quantized = nf4.quantize_model(zoo.Llama(preset("tiny"), key=jr.key(0)))
    config = lora.LoraConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    cfg = ztrain.TrainConfig(steps=4, batch_size=4, seq_len=32, warmup=1, lr=3e-3, log_every=1, eval_every=100,
                             eval_batches=1, checkpoint_every=2)  # fmt: skip
    full, _ = ztrain.train(lora.init(quantized, config, key=jr.key(1)), corpus, cfg, run_dir=tmp_path / "a")
    ztrain.train(lora.init(quantized, config, key=jr.key(1)), corpus, cfg, run_dir=tmp_path / "b", stop_after=2)
    resumed, _ = ztrain.train(lora.init(quantized, config, key=jr.key(1)), corpus, cfg, run_dir=tmp_path / "b",
                              resume=True, param_memory="pinned_host")  # fmt: skip
    for x, y in zip(jax.tree.leaves(full), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert json.loads((tmp_path / "a" / "run.json").read_text())["quantized_base"] == "nf4"
    for x, y in zip(jax.tree.leaves(full.base), jax.tree.leaves(quantized), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # the codes, as quantized
    assert full.base.layers.attn.wq.packed.dtype == jnp.uint8

    plain, history = ztrain.train(lora.init(nf4.dequantized(quantized), config, key=jr.key(1)), corpus, cfg)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    np.testing.assert_allclose(losses, [r["loss"] for r in history if "loss" in r], rtol=1e-6)
    for path, adapter in plain.adapters.items():
        for x, y in ((full.adapters[path].a, adapter.a), (full.adapters[path].b, adapter.b)):
            assert float(jnp.abs(x).max()) > 0
            # test_lora's tolerance for two runs of one model: Adam's normalised steps carry float32
            # rounding of the gradients (here 9e-8 of adapters up to 6e-3) into the values
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6, err_msg=path)
    state = ztrain.optimizer(cfg, full).init(eqx.filter(run_state(full)[0], eqx.is_inexact_array))
    moments = [x for x in jax.tree.leaves(state) if eqx.is_inexact_array(x) and x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(full.adapters))
    with pytest.raises(ConfigError, match=r"quantized weights.*zoo\.lora\.init"):
        ztrain.train(quantized, corpus, cfg)
    with pytest.raises(CheckpointError, match="base.layers.attn.wq"):  # resumed without the run's quantization
        ztrain.train(lora.init(nf4.dequantized(quantized), config, key=jr.key(1)), corpus, cfg, run_dir=tmp_path / "b",
                     resume=True)  # fmt: skip


def _recipe(name: str):
    return load_recipe(name, "_qlora")


def _train_recipe():
    return _recipe("train")


@pytest.mark.parametrize("fmt", [nf4, int8, fp8], ids=["nf4", "int8", "fp8"])
def test_recipe_qlora_trains_adapters_on_the_quantized_checkpoint(tmp_path, capsys, fmt):
    """`recipes/train.py --checkpoint DIR --lora r=8,alpha=16 --qlora nf4|int8`: the held-out loss
    falls; the saved adapters on the checkpoint's quantized weights (quantized again, as the run did)
    are the merged export (`--save-hf`: the dequantized weights plus the adapters);
    `--qlora` without `--lora` is refused naming both flags."""
    records = [{"text": (nf4.__doc__ or "") + f" {i}"} for i in range(40)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tiny = FIXTURES / "tokenizer-tiny"
    recipe = _train_recipe()
    flags = ["--checkpoint", str(tiny), "--data", str(data), "--data-cache", str(tmp_path / "c"), "--steps", "20",
             "--batch-size", "4", "--seq-len", "64", "--eval-every", "20", "--lr", "3e-3", "--peak-tflops", "1"]  # fmt: skip
    name = fmt.__name__.rsplit(".", 1)[1]
    recipe.main([*flags, "--run-dir", str(tmp_path / "run"), "--lora", "r=8,alpha=16", "--qlora", name,
                 "--save-adapter", str(tmp_path / "adapter"), "--save-hf", str(tmp_path / "merged")])  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert vals[-1] < vals[0] - 0.1, vals
    assert json.loads((tmp_path / "run" / "run.json").read_text())["quantized_base"] == name
    adapted = lora.load_adapter(fmt.quantize_model(zoo.from_pretrained(tiny)), tmp_path / "adapter")
    ids = jnp.arange(32).reshape(2, 16) % adapted.config.vocab_size
    merged = zoo.from_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(np.asarray(merged(ids)), np.asarray(adapted(ids)), atol=1e-5, rtol=0)
    with pytest.raises(SystemExit):
        recipe.parse_args([*flags, "--qlora", "nf4"])
    assert "--qlora needs --lora" in capsys.readouterr().err
    # recipes/eval.py --adapter A --qlora: the adapter on the base quantized as it was trained,
    # which is the merged export; without --qlora, the full-precision base (another loss)
    evaluate = _recipe("eval")
    ev = ["--max-rows", "4", "--seq-len", "32", "--data-cache", str(tmp_path / "ec")]
    as_trained = evaluate.main([str(tiny), "--adapter", str(tmp_path / "adapter"), "--qlora", name, *ev])["loss"]
    np.testing.assert_allclose(as_trained, evaluate.main([str(tmp_path / "merged"), *ev])["loss"], rtol=1e-6)
    assert as_trained != evaluate.main([str(tiny), "--adapter", str(tmp_path / "adapter"), *ev])["loss"]
    with pytest.raises(SystemExit):
        _recipe("generate").main([str(tiny), "--qlora", name, "--prompt", "def "])
    assert "--qlora goes with --adapter" in capsys.readouterr().err


def test_a_qlora_step_is_planned_within_10_percent_of_xla():
    """The planner traces a QLoRA step as training runs it (the NF4 codes in the run state, no
    moments for them): its estimate is within 10% of XLA:CPU's compiled step, and the step holds
    less than LoRA's by most of the weights' bytes NF4 saves. An abstract model (the planner's
    70B) quantizes to the same shapes as a real one."""
    from test_placement import FAST

    from zoo import plan
    from zoo.core.params import run_state
    from zoo.llama import preset

    base = zoo.Llama(preset("small"), key=jr.key(0))
    config = lora.LoraConfig(r=8, alpha=16, targets=("all-linear",))
    quantized = nf4.quantize_model(base)
    abstract = nf4.quantize_model(jax.eval_shape(lambda: base))
    assert jax.tree.structure(abstract) == jax.tree.structure(quantized)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)] == [(x.shape, x.dtype) for x in jax.tree.leaves(quantized)]
    kw = {"batch_size": 4, "seq_len": 128, "placement": "remat"}
    adapted, qlora = lora.init(base, config, key=jr.key(1)), lora.init(quantized, config, key=jr.key(1))
    got = plan.measure(qlora, compiler_options=FAST, **kw)
    assert abs(got.predicted.device_bytes / got.device_bytes - 1) <= 0.10, (got.predicted.device_bytes, got.device_bytes)
    saved = nf4.nbytes(run_state(adapted)[0]) - nf4.nbytes(run_state(qlora)[0])
    lora_bytes = plan.estimate(adapted, unified_memory=True, **kw).device_bytes
    assert got.predicted.device_bytes < lora_bytes - 0.9 * saved, (got.predicted.device_bytes, lora_bytes, saved)
    # With the parameters in pinned host memory, the codes stay there through the step and the
    # layer scan brings one layer's at a time: the device holds less by nearly all of them.
    codes = nf4.nbytes([x for x in jax.tree.leaves(qlora.base, is_leaf=lambda x: isinstance(x, QuantizedWeight))
                        if isinstance(x, QuantizedWeight)])  # fmt: skip
    on_device, on_host = (plan.estimate(qlora, param_memory=where, **kw) for where in ("device", "pinned_host"))
    assert on_host.device_bytes < on_device.device_bytes - 0.7 * codes, (on_host.device_bytes, on_device.device_bytes, codes)
    # On fsdp=8 the codes are split on their own dimension, as the weights are: a device holds an
    # eighth of them (before 2026-12-07 all of them: 2.31 MB where the bound is 1.40).
    packed = nf4.nbytes([x.packed for x in jax.tree.leaves(qlora.base, is_leaf=lambda x: isinstance(x, QuantizedWeight))
                         if isinstance(x, QuantizedWeight)])  # fmt: skip
    meshed = plan.estimate(qlora, mesh="fsdp=8", **{**kw, "batch_size": 8})
    assert meshed.params <= on_device.params - packed * 7 / 8, (meshed.params, on_device.params, packed)
