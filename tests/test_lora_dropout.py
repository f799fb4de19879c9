"""LoRA dropout (PEFT's ``lora_dropout``, zoo.lora.dropout): the adapters' inputs dropped while training.

The reference: with a mask that keeps a fixed set of input features (the same for every
row), PEFT's ``W x + s · B A (m ⊙ x) / (1 - p)`` is the adapted model without dropout whose ``A``
has the dropped features' columns zeroed and the rest scaled by ``1 / (1 - p)``, which the PEFT
parity tests of tests/test_lora.py hold to ``peft``'s logits. So the model with dropout, its
mask replaced by such a pattern, must give that model's loss, and (by the chain rule through
the column scaling) its gradients.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import zoo
from zoo import lora, parallel
from zoo.core.registry import family_of
from zoo.errors import ConfigError
from zoo.hooks import products
from zoo.lora import dropout

RATE = 0.25
# Every projection a named product reads: MLA's, the dense and shared experts' MLPs, the MTP
# block's (outside the layer stacks: its terms are the model call's). Not the routed experts.
TARGETS = {
    "llama": ("all-linear",),
    "deepseek_v3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj",
                    "mlp.down_proj", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"),
    "qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj"),
}  # fmt: skip


def _tiny(name: str):
    from zoo.deepseek_v3 import preset as deepseek_preset
    from zoo.llama import preset as llama_preset
    from zoo.qwen3 import preset as qwen3_preset

    make = {"llama": lambda: zoo.Llama(llama_preset("tiny"), key=jr.key(0)),
            "deepseek_v3": lambda: zoo.DeepseekV3(deepseek_preset("tiny", mtp=True), key=jr.key(0)),
            "qwen3_moe": lambda: zoo.Qwen3(qwen3_preset("tiny", "qwen3_moe"), key=jr.key(0))}  # fmt: skip
    return make[name]()


def _adapted(name: str, rate: float = RATE) -> lora.LoraModel:
    model = lora.init(_tiny(name), lora.LoraConfig(r=4, alpha=8, targets=TARGETS[name], dropout=rate), key=jr.key(2))
    keys = iter(jr.split(jr.key(3), len(model.adapters)))  # B nonzero: the adapters reach the loss
    return eqx.tree_at(lambda m: m.adapters, model, {k: lora.Adapter(a=v.a, b=0.05 * jr.normal(next(keys), v.b.shape))
                                                     for k, v in model.adapters.items()})  # fmt: skip


def _even_features(key, shape, rate):
    """A mask keeping the even features of the last dimension, the same in every row."""
    return jnp.broadcast_to(jnp.arange(shape[-1]) % 2 == 0, shape)


def _columns_dropped(model: lora.LoraModel, adapters: dict, parity: int = 0) -> dict:
    """``adapters`` with each ``A``'s columns of odd (``parity`` 1: even) last input feature
    zeroed, the rest scaled by 1 / (1 - p)."""
    specs, sizes = family_of(model.base).param_specs(model.base.config), model.base.config.sizes
    out = {}
    for path, ad in adapters.items():
        inputs = [sizes[x] for x in specs[path].hf_groups()[1]]
        keep = (jnp.arange(inputs[-1]) % 2 == parity).astype(ad.a.dtype) / (1 - model.lora.dropout)
        a = ad.a.reshape(*ad.a.shape[:-1], *inputs) * keep
        out[path] = lora.Adapter(a=a.reshape(ad.a.shape), b=ad.b)
    return out


def _loss(model, ids):
    out = model.loss(ids)
    return out[0] if isinstance(out, tuple) else out


def _reference(model: lora.LoraModel, ids, parity: int = 0):
    """The loss and adapter gradients of the adapted model without dropout whose ``A`` drops the mask's features."""
    plain = lora.LoraConfig(r=model.lora.r, alpha=model.lora.alpha, targets=model.lora.targets)

    def f(adapters):
        return _loss(lora.LoraModel(base=model.base, adapters=_columns_dropped(model, adapters, parity), lora=plain), ids)

    return jax.jit(jax.value_and_grad(f))(model.adapters)


def _check(got_loss, got, want_loss, want, model):
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for path in model.adapters:
        for g, w in ((got[path].a, want[path].a), (got[path].b, want[path].b)):
            w = np.asarray(w)
            assert np.abs(w).max() > 0, path
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=path)


# (DeepSeek-V3 on one device is the reference of its mesh case below.)
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_dropout_is_peft_dropout_with_a_known_mask(name, monkeypatch):
    """Issue 41 (rank, alpha, rsLoRA and dropout): with the mask fixed to keep the even input
    features, the loss and adapter gradients are those of the adapted model whose A drops the
    odd columns and scales the rest by 1 / (1 - p); without a key (evaluation) nothing is dropped."""
    model = _adapted(name)
    ids = jr.randint(jr.key(1), (2, 16), 0, model.config.vocab_size, dtype=jnp.int32)
    monkeypatch.setattr(dropout, "mask", _even_features)

    def f(adapters):
        with lora.dropout_key(jr.key(0)):
            return _loss(eqx.tree_at(lambda m: m.adapters, model, adapters), ids)

    loss, grads = jax.jit(jax.value_and_grad(f))(model.adapters)
    _check(loss, grads, *_reference(model, ids), model)
    plain = lora.LoraModel(base=model.base, adapters=model.adapters, lora=lora.LoraConfig(r=4, alpha=8, targets=TARGETS[name]))
    assert abs(float(loss) - float(_loss(plain, ids))) > 1e-4  # the mask changed the loss
    assert float(_loss(model, ids)) == float(_loss(plain, ids))  # no key: no dropout


MESHES = [
    ("llama", "fsdp=4,tensor=2", {}),
    ("deepseek_v3", "fsdp=2,expert=2,tensor=2", {}),
    ("llama", "pipeline=2,fsdp=2,tensor=2", {"microbatches": 4}),
    ("llama", "pipeline=2,fsdp=4", {"microbatches": 2, "schedule": "1f1b"}),
]


@pytest.mark.parametrize("name, spec, options", MESHES, ids=[f"{n}-{s}-{o.get('schedule', 'gpipe' if 'pipe' in s else '')}"
                                                            for n, s, o in MESHES])  # fmt: skip
def test_dropout_on_a_mesh_is_the_known_mask_reference(name, spec, options, monkeypatch):
    """Dropout's term made from the adapters' blocks as each product's weight is laid out
    (FSDP's gathered D, the tensor split's heads and hidden units, summed with the product over
    ``tensor``; a stage's layers, on GPipe's and 1F1B's schedules): on a mesh with the fixed
    mask, one device's reference loss and gradients."""
    model = _adapted(name)
    ids = jr.randint(jr.key(1), (8, 16), 0, model.config.vocab_size, dtype=jnp.int32)
    monkeypatch.setattr(dropout, "mask", _even_features)
    want_loss, want = _reference(model, ids)
    mesh = parallel.make_mesh(spec)
    lora.check_trainable(model, mesh=mesh)

    def f(m, ids):
        with lora.dropout_key(jr.key(0)):
            return _loss(m, ids)

    loss, grads = parallel.value_and_grad(f, mesh, frozen="none", **options)(parallel.shard(model, mesh), ids)
    _check(loss, parallel.unpad(grads).adapters, want_loss, want, model)


def test_random_masks_drop_at_the_rate_and_differ_by_key():
    """The masks keep 1 - p of the inputs; a step's key decides them (the same key, the same
    loss; another key, another); on a mesh the step runs with each device's own masks."""
    kept = dropout.mask(jr.key(0), (64, 1024), RATE)
    assert abs(float(kept.mean()) - (1 - RATE)) < 0.01
    model = _adapted("llama")
    ids = jr.randint(jr.key(1), (8, 16), 0, model.config.vocab_size, dtype=jnp.int32)

    def f(m, ids, key):
        with lora.dropout_key(key):
            return _loss(m, ids)

    losses = [float(jax.jit(f)(model, ids, jr.key(k))) for k in (0, 0, 1)]
    assert losses[0] == losses[1] and losses[0] != losses[2]
    mesh = parallel.make_mesh("data=2,fsdp=2,tensor=2")
    step = parallel.value_and_grad(lambda m, ids: f(m, ids, jr.key(0)), mesh, frozen="none")
    loss, grads = step(parallel.shard(model, mesh), ids)
    assert np.isfinite(float(loss)) and abs(float(loss) - losses[0]) < 0.05  # other masks, a loss of the same size
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads.adapters))


def test_dropout_where_its_path_is_missing_is_refused_naming_it():
    """Routed experts (read by grouped products, not a named one) are refused before the run; a
    term no product takes is refused where the layer is traced."""
    model = lora.init(_tiny("qwen3_moe"), lora.LoraConfig(r=2, alpha=4, targets=("gate_proj",), dropout=0.1), key=jr.key(0))
    with pytest.raises(ConfigError, match=r"moe_layers.moe.w_gate: the weight is not read by a named projection"):
        lora.check_trainable(model)
    with pytest.raises(ConfigError, match=r"LoRA dropout on layers.attn.wq \(product 'query'\): no zoo.layers.fp8.matmul"), \
            products.scope():
        products.add_term("query", lambda spec, x, w: x, "LoRA dropout on layers.attn.wq")


def test_the_train_step_drops_with_the_step_and_micro_batch():
    """zoo.train's step draws dropout's masks from the run's seed, the step index and the
    micro-batch: its loss is the adapted model's with ``dropout_key(fold_in(fold_in(root, step),
    micro))``, another step draws other masks, and two micro-batches of the same rows differ."""
    from zoo import train as ztrain
    from zoo.core.params import run_state
    from zoo.train.step import dropout_root

    model = _adapted("llama")
    ids = jr.randint(jr.key(1), (2, 16), 0, model.config.vocab_size, dtype=jnp.int32)
    cfg = ztrain.TrainConfig(steps=2, batch_size=2, seq_len=16, warmup=1, seed=3)
    tx = ztrain.optimizer(cfg, model)
    step = ztrain.make_train_step(model, cfg, tx)

    def loss_at(index, batch):
        params = jax.tree.map(jnp.copy, run_state(model)[0])  # the step donates them
        return float(step(params, tx.init(params), batch, jnp.int32(index))[2]["loss"])

    root = dropout_root(3)  # the run's seed's
    with lora.dropout_key(jr.fold_in(jr.fold_in(root, 5), 0)):
        want = float(_loss(model, ids))
    np.testing.assert_allclose(loss_at(5, ids[None]), want, rtol=1e-6)
    assert loss_at(6, ids[None]) != loss_at(5, ids[None])
    with lora.dropout_key(jr.fold_in(jr.fold_in(root, 5), 1)):
        second = float(_loss(model, ids))
    np.testing.assert_allclose(loss_at(5, jnp.stack([ids, ids])), (want + second) / 2, rtol=1e-6)
    assert second != want


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_draws_other_masks_for_other_micro_batches(schedule, monkeypatch):
    """A pipeline stage runs every micro-batch with the same weights (and their layer's key):
    the schedules say which micro-batch the layers run on, which dropout folds into the key.
    Checked with a mask that keeps the even features on micro-batch 0 and the odd ones on 1:
    on ``pipeline=2,data=4`` (two rows a device, one a micro-batch) the loss is the mean of the
    two references' on the rows each micro-batch holds."""
    from zoo.hooks import pipeline

    def by_microbatch(key, shape, rate):
        mb = pipeline.microbatch()
        if mb is None:  # 1F1B's trace of the stack's shapes (no values computed)
            return jnp.zeros(shape, bool)
        return jnp.broadcast_to(jnp.arange(shape[-1]) % 2 == mb % 2, shape)

    model = _adapted("llama")
    ids = jr.randint(jr.key(1), (8, 16), 0, model.config.vocab_size, dtype=jnp.int32)
    monkeypatch.setattr(dropout, "mask", by_microbatch)
    mesh = parallel.make_mesh("pipeline=2,data=4")

    def f(m, ids):
        with lora.dropout_key(jr.key(0)):
            return _loss(m, ids)

    loss, grads = parallel.value_and_grad(f, mesh, frozen="none", microbatches=2, schedule=schedule)(
        parallel.shard(model, mesh), ids)
    even_loss, even = _reference(model, ids[0::2])  # micro-batch 0: each device's first row
    odd_loss, odd = _reference(model, ids[1::2], parity=1)
    want = jax.tree.map(lambda a, b: (a + b) / 2, even, odd)
    _check(loss, parallel.unpad(grads).adapters, (even_loss + odd_loss) / 2, want, model)


def test_the_planner_prices_the_dropout_step():
    """The planner traces zoo.train's step, masks included (their keys are values of a PRNG key
    type, which its byte count once refused): the dropout step holds more than the plain one."""
    from zoo import plan

    model = _adapted("llama")
    plain = lora.LoraModel(base=model.base, adapters=model.adapters, lora=lora.LoraConfig(r=4, alpha=8, targets=TARGETS["llama"]))
    kw = {"batch_size": 4, "seq_len": 64, "placement": "remat"}
    with_dropout, without = plan.estimate(model, **kw), plan.estimate(plain, **kw)
    assert with_dropout.device_bytes > without.device_bytes
