"""The 1F1B pipeline schedule (zoo.parallel.one_f_one_b): loss and every gradient equal one
device's, and a stage's saved tensors are bounded by the stages, not the micro-batches.
(DeepSeek-V3 on interleaved 1F1B: tests/test_pipeline.py; measured outside the suite for its
time: V = 4 chunks of one layer, DeepSeek-V3 packed on ``pipeline=4,fsdp=2`` and
``pipeline=2,tensor=2,fsdp=2``, and GPipe on DeepSeek-V3 ``pipeline=2,fsdp=4``.)"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import pytest

import zoo
from zoo import parallel
from zoo import train as ztrain
from zoo.errors import MeshError
from zoo.llama import preset
from zoo.params import flatten

from helpers import train_on_a_mesh_like_one_device
from test_pipeline import _check_with_aux
from test_pipeline import _packed as _pipeline_packed


def _loss(model, ids, **kw):
    return zoo.lm_loss(model, ids, **kw)


def _llama(layers: int, tied: bool = False, **kw) -> zoo.Llama:
    return zoo.Llama(dataclasses.replace(preset("tiny"), num_layers=layers, tie_word_embeddings=tied, **kw), key=jr.key(0))


def _packed(rows: int, seq: int = 16) -> dict[str, jax.Array]:
    """Rows of two documents each (the second starting at 5, 9, 12 or nowhere)."""
    starts = np.array([5, 9, 12, seq] * (rows // 4))[:, None]
    segments = (np.arange(seq)[None, :] >= starts).astype(np.int32)
    positions = np.where(segments == 0, np.arange(seq), np.arange(seq) - starts)
    return {"segment_ids": jax.numpy.asarray(segments), "positions": jax.numpy.asarray(positions)}


def _check(model, spec: str, rows: int, microbatches: int, **kw):
    mesh = parallel.make_mesh(spec)
    ids = jr.randint(jr.key(1), (rows, 16), 0, model.config.vocab_size)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(_loss))(model, ids, **kw)
    step = parallel.value_and_grad(_loss, mesh, microbatches=microbatches, schedule="1f1b")
    loss, grads = step(parallel.shard(model, mesh), ids, **kw)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got, want = flatten(parallel.unpad(grads)), flatten(ref_grads)
    assert set(got) == set(want)
    for path, r in want.items():
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(got[path]), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=path)
    for path, g in flatten(grads).items():  # padding layers get exactly zero gradient
        if path.startswith("layers."):
            assert not np.any(np.asarray(g)[model.config.num_layers :]), path


@pytest.mark.parametrize(
    "spec, layers, tied, rows, microbatches, packed, placement",
    [("pipeline=2,fsdp=4", 3, False, 16, 4, True, None),  # M = 2P; 3 layers padded to 4; packed rows
     ("pipeline=4,fsdp=2", 6, True, 32, 16, False, "save_matmuls"),  # M = 4P: the ring of 7 slots wraps; tied; a map
     ("pipeline=2,tensor=2,fsdp=2", 4, False, 16, 8, True, "offload_attn")],  # tensor; offloaded names in the ring
)  # fmt: skip
def test_1f1b_equals_one_device(spec, layers, tied, rows, microbatches, packed, placement):
    _check(_llama(layers, tied), spec, rows, microbatches, **(_packed(rows) if packed else {}),
           **({"placement": placement} if placement else {}))  # fmt: skip


def test_1f1b_qwen3_dense_equals_one_device():
    from zoo.qwen3 import preset as qwen3_preset

    model = zoo.Qwen3(dataclasses.replace(qwen3_preset("tiny"), num_layers=4), key=jr.key(0))
    _check(model, "pipeline=2,fsdp=4", 16, 4)


@pytest.mark.parametrize("rows, microbatches, packed", [(16, 4, True), (32, 8, False)])  # M = 2P packed, M = 4P
def test_1f1b_qwen3_moe_balance_loss_equals_one_device(rows, microbatches, packed):
    """Qwen3-MoE's Switch balance loss is a product of whole-batch sums: 1F1B takes the whole
    batch's expert loads from a forward pass over it first, and each micro-batch's share of the
    loss, metrics and gradients adds up to one device's (the balance term weighted 1, not 0.001,
    so that a micro-batch's own loads would fail the loss's tolerance)."""
    from zoo.qwen3 import preset as qwen3_preset

    model = zoo.Qwen3(qwen3_preset("moe-tiny", num_layers=4, mlp_only_layers=(), router_aux_loss_coef=1.0),
                      key=jr.key(0))  # fmt: skip
    ids = jr.randint(jr.key(1), (rows, 16), 0, model.config.vocab_size)
    _check_with_aux(model, parallel.make_mesh("pipeline=2,expert=4"), ids, microbatches, {"moe_layers": 4},
                    schedule="1f1b", **(_pipeline_packed(rows) if packed else {}))  # fmt: skip


@pytest.mark.parametrize("spec, layers, microbatches, virtual, packed", [
    ("pipeline=4,fsdp=2", 6, 8, 2, True),  # 6 layers padded to 8: 2 chunks of one a stage; tied, packed
    ("pipeline=2,fsdp=4", 5, 4, 2, False),  # 5 layers padded to 6: chunks of 2 and 1 a stage (uneven)
])  # fmt: skip
def test_interleaved_1f1b_equals_one_device(spec, layers, microbatches, virtual, packed):
    """Interleaved 1F1B: each stage's layers in V chunks, the model in stage order, micro-batches
    round the ring of stages V times forward and back."""
    model = _llama(layers, tied=packed)
    ids = jr.randint(jr.key(1), (16, 16), 0, model.config.vocab_size)
    _check_with_aux(model, parallel.make_mesh(spec), ids, microbatches, {"layers": layers}, virtual, schedule="1f1b",
                    **(_pipeline_packed() if packed else {}))  # fmt: skip


def test_1f1b_keeps_a_bounded_number_of_microbatches():
    """XLA's compiled temporaries of a pipelined Llama step (``pipeline=4,data=2``, full remat):
    from M = 8 to M = 16 GPipe's grow by the 8 more micro-batches' saved layer inputs; 1F1B's do
    not grow at all, as its ring holds 2P - 1 = 7 micro-batches whatever M, and what precedes the
    stack runs per micro-batch too (its residuals in a ring of 2P)."""
    model = _llama(8)
    c = model.config
    mesh = parallel.make_mesh("pipeline=4,data=2")
    sharded = parallel.shard(model, mesh)
    seq = 64
    temps = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (8, 16):
            ids = jr.randint(jr.key(1), (2 * m, seq), 0, c.vocab_size)  # a row per micro-batch and device
            step = parallel.value_and_grad(_loss, mesh, microbatches=m, schedule=schedule)
            compiled = jax.jit(lambda s, i, step=step: step(s, i, placement="remat")).lower(sharded, ids).compile()
            temps[schedule, m] = compiled.memory_analysis().temp_size_in_bytes
    saved = 8 * (8 // 4) * seq * c.hidden_size * 4  # 8 micro-batches x 2 layers' inputs a stage
    grew = {s: temps[s, 16] - temps[s, 8] for s in ("gpipe", "1f1b")}
    assert grew["1f1b"] == 0 and grew["gpipe"] >= saved, (grew, saved)
    assert parallel.one_f_one_b.ring_slots(4, 16) == 7 and parallel.one_f_one_b.ring_slots(4, 4) == 4


def test_1f1b_trains_like_one_device_and_resumes_bit_for_bit(tmp_path):
    train_on_a_mesh_like_one_device(_llama(4), parallel.make_mesh("pipeline=2,fsdp=4"), tmp_path, microbatches=2,
                                    schedule="1f1b", grad_accum=2)  # fmt: skip


def test_what_1f1b_does_not_run_is_named():
    from zoo.qwen3 import preset as qwen3_preset

    mesh = parallel.make_mesh("pipeline=2,fsdp=4")
    ids = jr.randint(jr.key(1), (16, 16), 0, 64)
    with pytest.raises(MeshError, match="schedule must be one of"):
        parallel.value_and_grad(_loss, mesh, schedule="zero_bubble")
    with pytest.raises(MeshError, match=r"virtual_stages=2 \(interleaved 1F1B\) needs microbatches \(3\) a multiple"):
        step = parallel.value_and_grad(_loss, mesh, microbatches=3, virtual_stages=2, schedule="1f1b")
        step(parallel.to_stage_order(parallel.shard(_llama(4), mesh), mesh, 2), jr.randint(jr.key(1), (12, 16), 0, 64))
    moe_loss = parallel.value_and_grad(lambda m, i: m.loss(i)[0], mesh, microbatches=4, schedule="1f1b")
    moe = zoo.Qwen3(qwen3_preset("moe-tiny", num_layers=4, mlp_only_layers=(0,)), key=jr.key(0))
    with pytest.raises(MeshError, match="more than one pipelined layer stack"):
        moe_loss(parallel.shard(moe, mesh), ids)
    with pytest.raises(ValueError, match="schedule must be 'gpipe' or '1f1b'"):
        ztrain.TrainConfig(schedule="zb-v")
