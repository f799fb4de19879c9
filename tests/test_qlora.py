"""zoo.lora.nf4: QLoRA's NF4 base against bitsandbytes (tests/fixtures/nf4, written by
bitsandbytes 0.50.2: make_nf4_fixtures.py), and LoRA on it against LoRA on its dequantized
weights."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import FIXTURES

import zoo
from zoo import lora
from zoo.errors import ConfigError
from zoo.lora import nf4

BNB = np.load(FIXTURES / "nf4" / "bitsandbytes.npz")
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


@pytest.mark.parametrize("name", ["llama3_1-tiny", "qwen3_moe-tiny", "deepseek_v3-tiny"])
def test_lora_on_an_nf4_base_is_lora_on_its_dequantized_weights(name):
    """Every linear weight of the layer stacks in NF4 (about a quarter of float32's bytes with
    its scales): the model runs its dequantized weights, a layer at a time; LoRA on it has the
    loss and adapter gradients of LoRA on those weights, and merges into the same checkpoint."""
    base = zoo.from_pretrained(FIXTURES / name)
    quantized = nf4.quantize_model(base)
    plain = nf4.dequantized(quantized)
    ids = jnp.arange(32).reshape(2, 16) % base.config.vocab_size
    np.testing.assert_allclose(np.asarray(quantized(ids)), np.asarray(plain(ids)), atol=1e-5, rtol=0)
    assert float(jnp.abs(quantized(ids) - base(ids)).max()) > 1e-2  # NF4 changed the weights
    stacks = [x for x in jax.tree.leaves(quantized, is_leaf=lambda x: isinstance(x, nf4.NF4Weight))
              if isinstance(x, nf4.NF4Weight)]  # fmt: skip
    assert stacks and nf4.nbytes(stacks) < 0.3 * sum(x.stacked_value().nbytes for x in stacks)

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


def test_zoo_train_refuses_an_nf4_base_by_name(tmp_path):
    from zoo import train as ztrain
    from zoo.data import stdlib_corpus
    from zoo.llama import preset

    base = nf4.quantize_model(zoo.Llama(preset("tiny"), key=jr.key(0)))
    model = lora.init(base, lora.LoraConfig(r=4, alpha=8, targets=("q_proj",)), key=jr.key(1))
    cfg = ztrain.TrainConfig(steps=1, batch_size=2, seq_len=16, warmup=0)
    with pytest.raises(ConfigError, match="NF4 base"):
        ztrain.train(model, stdlib_corpus(max_bytes=2**16), cfg, run_dir=tmp_path)
