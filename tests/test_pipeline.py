"""Pipeline parallelism (zoo.pipeline): the layer stack in stages over the ``pipeline`` mesh
axis, micro-batches passed between stages; loss and every gradient equal one device's."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import pytest

import zoo
from zoo import parallel
from zoo.core.mesh import virtual_options
from zoo.errors import MeshError
from zoo.hooks.pipeline import chunk_layers, in_layer_order
from zoo.llama import preset
from zoo.params import flatten
from zoo.pipeline import bubble, reorder_stacks, stage_order, to_stage_order
from zoo.plan import collectives

from helpers import free_port, train_on_a_mesh_like_one_device

ROOT = Path(__file__).resolve().parents[1]


def _loss(model, ids, **kw):
    return zoo.lm_loss(model, ids, **kw)


def _llama(layers: int, tied: bool = False) -> zoo.Llama:
    config = dataclasses.replace(preset("tiny"), num_layers=layers, tie_word_embeddings=tied)
    return zoo.Llama(config, key=jr.key(0))


def _reference(fn, model, ids, has_aux=False, **kw):
    """One device's value and gradients, compiled: run op by op, a DeepSeek-V3 reference took
    3x as long as the pipelined step it checks."""
    return eqx.filter_jit(eqx.filter_value_and_grad(fn, has_aux=has_aux))(model, ids, **kw)


def _check(model, mesh, ids, microbatches, virtual=1, **kw):
    """Loss and every gradient equal one device's; padding layers get zero gradient. With
    ``virtual`` chunks per stage, the interleaved schedule on the model in stage order."""
    ref_loss, ref_grads = _reference(_loss, model, ids, **kw)
    step = parallel.value_and_grad(_loss, mesh, microbatches=microbatches, virtual_stages=virtual)
    sharded = parallel.shard(model, mesh)
    loss, grads = step(to_stage_order(sharded, mesh, virtual), ids, **kw)
    grads = to_stage_order(grads, mesh, virtual, inverse=True)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got, want, padded = flatten(parallel.unpad(grads)), flatten(ref_grads), flatten(grads)
    assert set(got) == set(want)
    for path, r in want.items():
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(got[path]), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=path)
    for path, g in padded.items():  # padding layers get exactly zero gradient
        if path.startswith("layers."):
            assert not np.any(np.asarray(g)[model.config.num_layers :]), path
    return sharded


@pytest.mark.parametrize(
    "spec, layers, tied",
    [("pipeline=2,fsdp=4", 3, False), ("pipeline=4,fsdp=2", 6, True), ("pipeline=2,tensor=2,fsdp=2", 4, False),
     ("pipeline=2,context=2,fsdp=2", 3, False)],
)
def test_pipelined_step_equals_one_device(spec, layers, tied):
    """Layer counts that do not divide the stages (3 on 2, 6 on 4) are padded with zero layers
    that are skipped; tied and untied heads; 4 micro-batches."""
    model = _llama(layers, tied)
    mesh = parallel.make_mesh(spec)
    ids = jr.randint(jr.key(1), (16, 16), 0, model.config.vocab_size)
    sharded = _check(model, mesh, ids, 4)
    stages = mesh.shape["pipeline"]
    per_stage = -(-layers // stages)
    wq = sharded.layers.attn.wq
    assert wq.shape[0] == per_stage * stages
    assert {s.data.shape[0] for s in wq.addressable_shards} == {per_stage}  # each device: its stage's layers


def _packed(rows: int = 16, seq: int = 16) -> dict[str, jax.Array]:
    """Rows of two documents each (the second starting at 5, 9, 12 or nowhere)."""
    starts = np.array([5, 9, 12, seq] * (rows // 4))[:, None]
    segments = (np.arange(seq)[None, :] >= starts).astype(np.int32)
    positions = np.where(segments == 0, np.arange(seq), np.arange(seq) - starts)
    return {"segment_ids": jax.numpy.asarray(segments), "positions": jax.numpy.asarray(positions)}


def test_packed_rows_pipelined():
    model = _llama(4)
    mesh = parallel.make_mesh("pipeline=2,fsdp=4")
    ids = jr.randint(jr.key(1), (16, 16), 0, model.config.vocab_size)
    _check(model, mesh, ids, 4, **_packed())


def test_the_schedule_passes_activations_point_to_point():
    """The compiled step moves activations by collective-permute, never all-gathers the layer
    stack over the pipeline axis, and all-reduces over it as many bytes whatever the number of
    micro-batches (the first stage's input gradient was all-reduced whole at every tick:
    M·(M+P-1) rows for M)."""
    model = _llama(4)
    mesh = parallel.make_mesh("pipeline=4,fsdp=2")
    ids = jr.randint(jr.key(1), (8, 16), 0, model.config.vocab_size)
    reduced = []
    for m in (2, 4):
        step = parallel.value_and_grad(_loss, mesh, microbatches=m)
        hlo = jax.jit(step).lower(parallel.shard(model, mesh), ids).compile().as_text()
        assert "collective-permute" in hlo
        traffic = collectives.hlo_traffic(hlo, dict(mesh.shape))
        assert ("all_gather", ("fsdp",)) in traffic  # the layers' FSDP gathers, within a stage
        assert not [key for key in traffic if key[0] == "all_gather" and "pipeline" in key[1]], traffic
        reduced.append(traffic[("all_reduce", ("pipeline",))])
    assert reduced[0] == reduced[1], reduced
    assert bubble(4, 4) == pytest.approx(3 / 7) and bubble(4, 16) == pytest.approx(3 / 19)


@pytest.mark.parametrize(
    "spec, layers, microbatches, virtual, tied, packed, placement",
    [("pipeline=4,fsdp=2", 6, 4, 2, True, True, None),  # 6 layers padded to 8: 2 chunks of 1 per stage; tied; packed
     # 5 layers padded to 6: chunks of 2 and 1 a stage (a short last chunk); a map: the chunk
     # picked again in the backward
     ("pipeline=2,fsdp=4", 5, 4, 2, False, False, "save_matmuls")],
)
def test_the_interleaved_schedule_equals_one_device(spec, layers, microbatches, virtual, tied, packed, placement):
    """V chunks per stage, the stacks in stage order (device s holds layers s, s + P, ... in
    chunks), the micro-batches going round the stages V times: loss and every gradient equal
    one device's, with no map (every named tensor kept) and with one."""
    model = _llama(layers, tied)
    mesh = parallel.make_mesh(spec)
    ids = jr.randint(jr.key(1), (16, 16), 0, model.config.vocab_size)
    _check(model, mesh, ids, microbatches, virtual, **(_packed() if packed else {}),
           **({"placement": placement} if placement else {}))  # fmt: skip


def test_stage_order_and_the_interleaved_bubble(tmp_path):
    np.testing.assert_array_equal(stage_order(8, 2, 2), [0, 1, 4, 5, 2, 3, 6, 7])  # stage 0: chunks 0, 2
    np.testing.assert_array_equal(stage_order(8, 4, 2), [0, 4, 1, 5, 2, 6, 3, 7])
    np.testing.assert_array_equal(stage_order(6, 2, 1), np.arange(6))  # GPipe: contiguous stages
    # Uneven chunks (Megatron's layouts): 3 layers a stage in chunks of 2 and 1; the ring runs
    # chunk 0 of both stages (layers 0-1, 2-3), then chunk 1 (4, 5).
    np.testing.assert_array_equal(stage_order(6, 2, 2), [0, 1, 4, 2, 3, 5])
    np.testing.assert_array_equal(chunk_layers(2, 2, 3), [[[0, 1], [4, -1]], [[2, 3], [5, -1]]])
    # DeepSeek-V3's 58 MoE layers padded to 60 on Megatron-Bridge's PP 4, VP 4: chunks of 4, 4, 4, 3.
    order = stage_order(60, 4, 4)
    assert sorted(order) == list(range(60)) and list(order[:15]) == [0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50]
    assert virtual_options(15) == [1, 2, 3, 4, 5, 8, 15]  # 6: chunks of 3 leave the sixth empty
    # A per-layer output laid out over the chunks' places [V, P, c] comes back in layer order.
    table = chunk_layers(4, 4, 15)
    full = np.where(table >= 0, table, -7).transpose(1, 0, 2).ravel()  # [V, P, c] of layer ids
    np.testing.assert_array_equal(np.asarray(in_layer_order(jax.numpy.asarray(full), 4, 4, 15, 58)), np.arange(58))
    assert bubble(4, 8, 2) == pytest.approx(3 / 19) and bubble(4, 8) == pytest.approx(3 / 11)
    model = _llama(4)
    mesh = parallel.make_mesh("pipeline=2,fsdp=4")
    ids = jr.randint(jr.key(1), (8, 16), 0, model.config.vocab_size)
    placed = parallel.shard(model, mesh)
    there = to_stage_order(placed, mesh, 2)
    np.testing.assert_array_equal(
        np.asarray(there.model.layers.attn.wq), np.asarray(placed.layers.attn.wq)[[0, 2, 1, 3]]
    )
    back = to_stage_order(there, mesh, 2, inverse=True)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(placed)))
    # The order is carried, so a mismatch cannot compute: the interleaved step refuses a model in
    # layer order (it returned 5.6057 for 5.6298), a save or a GPipe step one in stage order.
    step = parallel.value_and_grad(_loss, mesh, microbatches=2, virtual_stages=2)
    with pytest.raises(
        zoo.ConfigError,
        match=r"virtual_stages=2: the interleaved schedule takes the model with its stacks in stage order",
    ):
        step(placed, ids)
    with pytest.raises(
        zoo.ConfigError, match=r"stage order of 2 pipeline stages x 2 virtual stages; this step runs 1 x 1"
    ):
        parallel.value_and_grad(_loss, mesh, microbatches=2)(there, ids)
    with pytest.raises(zoo.ConfigError, match=r"save_pretrained: the model's layer stacks are in the stage order"):
        zoo.save_pretrained(there, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    with pytest.raises(zoo.ConfigError, match=r"runs only in the interleaved step"):
        there(ids)
    with pytest.raises(zoo.ConfigError, match="in stage order already"):
        to_stage_order(there, mesh, 2)
    with pytest.raises(zoo.ConfigError, match="in layer order already"):
        to_stage_order(placed, mesh, 2, inverse=True)
    with pytest.raises(MeshError, match=r"microbatches \(1\) a multiple of the 2 stages"):
        parallel.value_and_grad(_loss, mesh, microbatches=1, virtual_stages=2)(there, ids)
    with pytest.raises(MeshError, match=r"virtual_stages=3 cannot split a stage's 2 layers .*possible: \[1, 2\]"):
        to_stage_order(placed, mesh, 3)
    from zoo.qwen3 import preset as qwen3_preset  # two dense layers a repeat: stage order moves single layers

    qwen = zoo.Qwen3(qwen3_preset("tiny", "qwen3_moe", num_layers=12, mlp_only_layers=(), decoder_sparse_step=3), key=jr.key(0))
    qwen_mesh = parallel.make_mesh("pipeline=2,expert=4")
    with pytest.raises(MeshError, match=r"needs one dense layer per repeat of the layer pattern"):
        step = parallel.value_and_grad(_family_loss, qwen_mesh, has_aux=True, microbatches=2, virtual_stages=2)
        step(to_stage_order(parallel.shard(qwen, qwen_mesh), qwen_mesh, 2), ids)


def test_the_validation_loss_runs_pipelined_not_gathered():
    """zoo.train's evaluation on a pipeline mesh runs as the step does (zoo.parallel.value):
    a plain jit of the loss on the placed model made XLA all-gather every layer stack over
    ``pipeline`` (the whole model on every device); the loss is one device's."""
    from zoo.train import make_eval

    model = _llama(4)
    mesh = parallel.make_mesh("pipeline=4,fsdp=2")
    ids = jr.randint(jr.key(1), (8, 16), 0, model.config.vocab_size)
    sharded = parallel.shard(model, mesh)
    params = eqx.filter(sharded, eqx.is_inexact_array)
    evaluate = make_eval(sharded, mesh=mesh, microbatches=2)
    np.testing.assert_allclose(float(evaluate(params, ids)), float(zoo.lm_loss(model, ids)), rtol=1e-5)
    hlo = jax.jit(evaluate).lower(params, ids).compile().as_text()
    traffic = collectives.hlo_traffic(hlo, dict(mesh.shape))
    assert "collective-permute" in hlo
    assert not [key for key in traffic if key[0] == "all_gather" and "pipeline" in key[1]], traffic
    plain = jax.jit(make_eval(sharded)).lower(params, ids).compile().as_text()  # what it was
    assert [key for key in collectives.hlo_traffic(plain, dict(mesh.shape)) if key[0] == "all_gather" and "pipeline" in key[1]]


def test_microbatches_that_do_not_divide_the_rows_are_named():
    model = _llama(2)
    mesh = parallel.make_mesh("pipeline=2,fsdp=4")
    ids = jr.randint(jr.key(1), (8, 16), 0, model.config.vocab_size)
    with pytest.raises(MeshError, match=r"microbatches=4 must divide each device's 2 rows"):
        parallel.value_and_grad(_loss, mesh, microbatches=4)(parallel.shard(model, mesh), ids)


# -- MoE families: router statistics as per-layer outputs of a pipelined stack ------------


def _family_loss(model, ids, **kw):
    """The family's training objective with its metrics (loss parts, expert load)."""
    if isinstance(model, zoo.DeepseekV3):
        from zoo.deepseek_v3 import deepseek_v3_loss

        total, metrics = deepseek_v3_loss(model, ids, **kw)
        return total, metrics._asdict()
    return model.loss(ids, **kw)


def _check_with_aux(model, mesh, ids, microbatches, stacks, virtual=1, reference=None, schedule="gpipe", **kw):
    """Loss, every metric (integers exactly) and every gradient equal one device's (``reference``:
    them, computed already); the padding layers of the pipelined ``stacks`` (``{root: real layer
    count}``) get zero gradient."""
    if reference is None:
        reference = _reference(_family_loss, model, ids, has_aux=True, **kw)
    (ref_loss, ref_aux), ref_grads = reference
    step = parallel.value_and_grad(_family_loss, mesh, has_aux=True, microbatches=microbatches, virtual_stages=virtual,
                                   schedule=schedule)  # fmt: skip
    sharded = parallel.shard(model, mesh)
    (loss, aux), grads = step(to_stage_order(sharded, mesh, virtual), ids, **kw)
    grads = to_stage_order(grads, mesh, virtual, inverse=True)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert set(aux) == set(ref_aux)
    for name, want in ref_aux.items():
        got, want = np.asarray(aux[name]), np.asarray(want)
        assert got.shape == want.shape, name
        if np.issubdtype(want.dtype, np.integer):  # expert load: counts, exactly
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)
    got, want, padded = flatten(parallel.unpad(grads)), flatten(ref_grads), flatten(grads)
    assert set(got) == set(want)
    for path, r in want.items():
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(got[path]), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=path)
    for root, n in stacks.items():
        leaves = [g for path, g in padded.items() if path.startswith(f"{root}.")]
        assert leaves and {g.shape[0] for g in leaves} == {-(-n // mesh.shape["pipeline"]) * mesh.shape["pipeline"]}
        for g in leaves:
            assert not np.any(np.asarray(g)[n:])
    return aux


@functools.cache
def _deepseek_v3_reference(packed: bool):
    """A DeepSeek-V3 with MTP (a dense layer, 3 MoE layers), its batch and one device's loss,
    metrics and gradients (computed once for the meshes that share them)."""
    from zoo.deepseek_v3 import preset as deepseek_preset

    model = zoo.DeepseekV3(deepseek_preset("tiny", num_layers=4, mtp=True), key=jr.key(0))
    ids = jr.randint(jr.key(1), (16, 16), 0, model.config.vocab_size)
    return model, ids, _reference(_family_loss, model, ids, has_aux=True, **(_packed() if packed else {}))


@pytest.mark.parametrize(
    "spec, virtual, packed, schedule", [("pipeline=4,fsdp=2", 1, True, "gpipe"),
                                        ("pipeline=2,tensor=2,fsdp=2", 1, True, "gpipe"),
                                        ("pipeline=2,expert=4", 2, False, "1f1b")],  # interleaved 1F1B: 2 chunks of one MoE layer a stage
)  # fmt: skip
# (GPipe on pipeline=2,expert=4 was dropped for the suite's time on 2026-12-07: the stages with
# an expert group run under interleaved 1F1B here, and GPipe's DeepSeek-V3 on the two meshes above.)
def test_deepseek_v3_pipelined_equals_one_device(spec, virtual, packed, schedule):
    """The MoE stack (3 layers on 2 stages: one padding layer; on 4, one) pipelined, the dense
    first layer and the MTP block on every stage; the balance loss (a mean over sequences,
    averaged over micro-batches) and the per-layer expert load (summed) equal one device's;
    plain and packed rows; on interleaved 1F1B too (zoo.parallel.one_f_one_b: each micro-batch's
    share of the per-layer outputs reaching its own tail, their gradients back)."""
    model, ids, reference = _deepseek_v3_reference(packed)
    mesh = parallel.make_mesh(spec)
    aux = _check_with_aux(model, mesh, ids, 4, {"moe_layers": 3}, virtual, reference=reference, schedule=schedule,
                          **(_packed() if packed else {}))  # fmt: skip
    assert np.asarray(aux["expert_load"]).shape == (3, model.config.n_routed_experts)
    sharded = parallel.shard(model, mesh)
    assert sharded.moe_layers.attn.wkv_a.sharding.spec[0] == "pipeline"
    assert sharded.dense_layers.attn.wkv_a.sharding.spec[0] is None  # kept whole on every stage


@functools.cache
def _qwen3_reference(model_type: str, overrides: tuple, packed: bool):
    """A Qwen3 of ``model_type`` with ``overrides``, its batch and one device's loss, metrics and
    gradients (computed once for the meshes that share them)."""
    from zoo.qwen3 import preset as qwen3_preset

    model = zoo.Qwen3(qwen3_preset("tiny", model_type, **dict(overrides)), key=jr.key(0))
    ids = jr.randint(jr.key(1), (16, 16), 0, model.config.vocab_size)
    return model, ids, _reference(_family_loss, model, ids, has_aux=True, **(_packed() if packed else {}))


@pytest.mark.parametrize(
    "model_type, overrides, spec, stacks, packed, virtual",
    [
        # Dense, untied head, 3 layers on 2 stages (one padding layer), FSDP inside each stage.
        ("qwen3", {"num_layers": 3, "tie_word_embeddings": False}, "pipeline=2,fsdp=4", {"dense_layers": 3}, False, 1),
        # Dense, tied head, 6 layers on 4 stages (two padding layers), packed rows.
        ("qwen3", {"num_layers": 6}, "pipeline=4,fsdp=2", {"dense_layers": 6}, True, 1),
        # Dense, heads split over tensor inside each stage, packed rows.
        ("qwen3", {"num_layers": 4}, "pipeline=2,tensor=2,fsdp=2", {"dense_layers": 4}, True, 1),
        # A dense first layer, then 3 MoE layers: two blocks, each a GPipe pass over its whole stack.
        ("qwen3_moe", {"num_layers": 4}, "pipeline=2,expert=4", {"dense_layers": 1, "moe_layers": 3}, False, 1),
        # The same on 2 and on 4 stages with FSDP (experts whole on each device), packed rows on 4.
        ("qwen3_moe", {"num_layers": 4}, "pipeline=2,fsdp=4", {"dense_layers": 1, "moe_layers": 3}, False, 1),
        ("qwen3_moe", {"num_layers": 4}, "pipeline=4,fsdp=2", {"dense_layers": 1, "moe_layers": 3}, True, 1),
        # Dense and MoE alternating: one block of 3 (dense, moe) repeats, both stacks in one pass;
        # heads and expert hidden units split over tensor inside each stage.
        ("qwen3_moe", {"num_layers": 6, "mlp_only_layers": (), "decoder_sparse_step": 2}, "pipeline=2,tensor=2,fsdp=2",
         {"dense_layers": 3, "moe_layers": 3}, False, 1),
        # The same on the interleaved schedule, 6 repeats: chunks of 2 repeats and 1 a stage (a
        # short last chunk, so the per-layer outputs come back from the chunks out of order).
        ("qwen3_moe", {"num_layers": 12, "mlp_only_layers": (), "decoder_sparse_step": 2}, "pipeline=2,expert=4",
         {"dense_layers": 6, "moe_layers": 6}, False, 2),
    ],
    ids=["qwen3-untied", "qwen3-4-stages-packed", "qwen3-tensor-packed", "qwen3_moe-dense-first", "qwen3_moe-fsdp",
         "qwen3_moe-4-stages-packed",
         "qwen3_moe-alternating-tensor", "qwen3_moe-alternating-interleaved"],
)
def test_qwen3_pipelined_equals_one_device(model_type, overrides, spec, stacks, packed, virtual):
    """Loss, balance loss, expert load (exactly) and every gradient equal one device's, with 4
    micro-batches; the router probabilities' sums and the load come out of the stages as
    per-layer outputs."""
    model, ids, reference = _qwen3_reference(model_type, tuple(overrides.items()), packed)
    mesh = parallel.make_mesh(spec)
    aux = _check_with_aux(model, mesh, ids, 4, stacks, virtual, reference=reference, **(_packed() if packed else {}))
    if "moe_layers" in stacks:
        assert np.asarray(aux["expert_load"]).shape == (stacks["moe_layers"], model.config.num_experts)
        assert float(aux["balance_loss"]) > 0


def test_per_layer_outputs_leading_with_rows_come_back_in_row_order():
    """Hidden states (``return_hidden``: per-layer outputs that lead with the rows) are put back
    together from the micro-batches in row order, padding layers cut off."""

    def loss(model, ids):
        hidden = model.forward(ids, return_hidden=True)[1]  # [L + 1, B, S, D]
        probe = jax.numpy.mean(hidden[..., 0] * ids.astype(hidden.dtype), axis=(1, 2))  # row-dependent, per layer
        return zoo.lm_loss(model, ids) + 1e-3 * jax.numpy.sum(probe), probe

    model = _llama(3)
    mesh = parallel.make_mesh("pipeline=2,fsdp=4")
    ids = jr.randint(jr.key(1), (16, 16), 0, model.config.vocab_size)
    (ref_loss, ref_probe), ref_grads = _reference(loss, model, ids, has_aux=True)
    (got_loss, probe), grads = parallel.value_and_grad(loss, mesh, has_aux=True, microbatches=2)(parallel.shard(model, mesh), ids)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    assert probe.shape == (4,)
    np.testing.assert_allclose(np.asarray(probe), np.asarray(ref_probe), rtol=1e-5)
    got, want = flatten(parallel.unpad(grads)), flatten(ref_grads)
    for path, r in want.items():
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(got[path]), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=path)


def test_an_interleaved_run_trains_resumes_and_loads_in_layer_order(tmp_path):
    """zoo.train with virtual_stages=2 (and 2 accumulated micro-batches around the 2 pipeline
    micro-batches) keeps the stacks in stage order (checkpoints too) and follows one device's losses, resumes bit for bit, returns and loads (load_run) the model in
    layer order; resuming it with other virtual stages is refused before anything runs."""
    from zoo import train as ztrain

    model = _llama(4)
    mesh = parallel.make_mesh("pipeline=2,fsdp=4")
    settings = {"microbatches": 2, "virtual_stages": 2, "grad_accum": 2}
    loaded, step, _ = train_on_a_mesh_like_one_device(model, mesh, tmp_path, **settings)
    assert step == 4
    cfg = ztrain.TrainConfig(steps=4, batch_size=8, seq_len=32, warmup=1, lr=3e-3, log_every=1, eval_every=4,
                             eval_batches=1, checkpoint_every=2, **settings)  # fmt: skip
    from zoo.data import stdlib_corpus

    trained, _ = ztrain.train(model, stdlib_corpus(max_bytes=2**20), cfg, run_dir=tmp_path / "cut", mesh=mesh,
                              resume=True)  # fmt: skip  (finished: returns the restored model)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a)[: np.shape(b)[0]] if np.ndim(a) else a, np.asarray(b))
    # In layer order: each layer's weights are the one-device run's, not another layer's.
    one = ztrain.load_run(tmp_path / "one")[0]
    for path, w in flatten(one).items():
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(flatten(loaded)[path]), w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()),
                                   err_msg=path)  # fmt: skip
    other = dataclasses.replace(cfg, virtual_stages=1)
    with pytest.raises(zoo.ConfigError, match=r"stage order of 2 pipeline stages x 2 virtual stages.*1 x 1"):
        ztrain.train(model, stdlib_corpus(max_bytes=2**20), other, run_dir=tmp_path / "cut", mesh=mesh, resume=True)


def test_the_router_bias_update_follows_the_stage_order():
    """DeepSeek-V3's after_step adds each layer's load to that layer's router bias, also when
    the run keeps the MoE stack in stage order (3 layers padded to 4, 2 chunks a stage)."""
    from zoo.deepseek_v3 import preset as deepseek_preset
    from zoo.pipeline import stacks_in_stage_order

    model = zoo.DeepseekV3(deepseek_preset("tiny", num_layers=4), key=jr.key(0))
    mesh = parallel.make_mesh("pipeline=2,expert=4")
    placed = parallel.shard(model, mesh)
    load = jr.randint(jr.key(2), (3, model.config.n_routed_experts), 0, 50)
    want = parallel.unpad(placed.after_step({"expert_load": load}))
    with stacks_in_stage_order(2, 2):
        got = reorder_stacks(reorder_stacks(placed, mesh, 2).after_step({"expert_load": load}), mesh, 2, inverse=True)
    np.testing.assert_array_equal(np.asarray(parallel.unpad(got).moe_layers.moe.router_bias),
                                  np.asarray(want.moe_layers.moe.router_bias))  # fmt: skip
    assert np.any(np.asarray(want.moe_layers.moe.router_bias))


def test_a_checkpoint_loads_into_the_padded_stages_and_saves_its_true_shapes(fixtures, tmp_path):
    """The 2-layer fixture on pipeline=4: read straight into 4 stages of one layer (2 of them
    padding, zeros), saved back with 2 layers and the same values."""
    mesh = parallel.make_mesh("pipeline=4,fsdp=2")
    placed = zoo.from_pretrained(fixtures / "llama3_1-tiny", mesh=mesh)
    whole = flatten(zoo.from_pretrained(fixtures / "llama3_1-tiny"))
    wq = placed.layers.attn.wq
    assert wq.shape[0] == 4 and wq.sharding.spec[0] == "pipeline" and not np.any(np.asarray(wq)[2:])
    zoo.save_pretrained(placed, tmp_path / "saved")
    for arrays in (flatten(parallel.unpad(placed)), flatten(zoo.from_pretrained(tmp_path / "saved"))):
        assert set(arrays) == set(whole)
        for path, x in whole.items():
            np.testing.assert_array_equal(np.asarray(arrays[path]), np.asarray(x), err_msg=path)


def test_the_vocabulary_is_split_over_the_stages():
    """The embedding and head are split over the stages (which share their tokens) as well as
    over FSDP: each device holds 1/(P·F) of the rows, no stage holds the whole matrix, and
    loss and gradients equal one device's, also where a stage's part is padding only (a
    9-token vocabulary over 4 stages x 2: rows 12..15 of stage 3 are all padding) and through
    the model's whole logits (the head gathered for a model call inside the step)."""
    config = dataclasses.replace(preset("tiny"), num_layers=2, vocab_size=9, tie_word_embeddings=False)
    model = zoo.Llama(config, key=jr.key(0))
    mesh = parallel.make_mesh("pipeline=4,fsdp=2")
    ids = jr.randint(jr.key(1), (8, 16), 0, config.vocab_size)
    sharded = _check(model, mesh, ids, 2)
    split = parallel.vocab_split_of(model, mesh)
    assert (split.stage_axis, split.stages, split.axis, split.devices) == ("pipeline", 4, "fsdp", 2)
    for table in (sharded.embed, sharded.head):
        assert table.shape[0] == 16 and {s.data.shape[0] for s in table.addressable_shards} == {2}

    def logits_loss(m, ids):
        logp = jax.nn.log_softmax(m(ids[:, :-1]), axis=-1)
        return -jax.numpy.mean(jax.numpy.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    ref_loss, ref_grads = _reference(logits_loss, model, ids)
    loss, grads = parallel.value_and_grad(logits_loss, mesh, microbatches=2)(sharded, ids)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for path, r in flatten(ref_grads).items():
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(flatten(parallel.unpad(grads))[path]), r, rtol=1e-5,
                                   atol=1e-5 * float(np.abs(r).max()), err_msg=path)  # fmt: skip


def test_the_recipe_trains_pipelined_across_two_processes_like_one_and_resumes_bit_for_bit(tmp_path):
    """recipes/train.py on pipeline=2,fsdp=4 with 4 micro-batches: 2 processes x 4 CPU devices
    (pipeline outermost, so each process holds one stage and every row) on the 1F1B schedule,
    its hand-overs both ways between the processes, log the losses of 1 process x 8 on GPipe's;
    the one-process run, its step-4 checkpoint deleted (as if stopped after step 2), resumes
    from step 2 and logs steps 3 and 4 bit for bit."""
    text = tmp_path / "corpus.txt"  # bytes: no tokenizer
    text.write_text((ROOT / "zoo" / "train" / "loop.py").read_text() + (ROOT / "zoo" / "core" / "layout.py").read_text()
              + (ROOT / "zoo" / "parallel" / "step.py").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")

    def recipe(run: str, devices: int, *extra: str) -> list[str]:
        # 16 rows over fsdp=4: 4 per device, one per micro-batch.
        return [sys.executable, str(ROOT / "recipes" / "train.py"), "--preset", "tiny", "--data", str(text),
                "--steps", "4", "--batch-size", "16", "--seq-len", "32", "--log-every", "1", "--eval-every", "4",
                "--checkpoint-every", "2", "--mesh", "pipeline=2,fsdp=4", "--microbatches", "4",
                "--cpu-devices", str(devices), "--run-dir", str(tmp_path / run),
                "--data-cache", str(tmp_path / f"cache-{run}"), "--peak-tflops", "1", *extra]  # fmt: skip

    def run(*command: str) -> str:
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return out.stdout

    def losses(name: str) -> list[tuple[int, float]]:
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in records if "loss" in r]

    port = free_port()
    processes = ("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2")
    two = [subprocess.Popen(recipe("two", 4, *processes, "--process-id", str(i), "--schedule", "1f1b"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]  # fmt: skip
    try:
        run(*recipe("one", 8))
        first = losses("one")
        assert sorted(p.name for p in (tmp_path / "one" / "checkpoints").iterdir()) == ["2", "4"]
        shutil.rmtree(tmp_path / "one" / "checkpoints" / "4")  # the newest: a resume falls back to step 2
        resumed = run(*recipe("one", 8, "--resume"))  # while the two processes still run
        assert f"resumed from {tmp_path / 'one' / 'checkpoints'} at step 2\n" in resumed, resumed[-2000:]
        again = losses("one")
        assert [s for s, _ in first] == [s for s, _ in again] == [1, 2, 3, 4]
        np.testing.assert_array_equal([x for _, x in again], [x for _, x in first])  # 1, 2 kept; 3, 4 recomputed
        for i, p in enumerate(two):
            out, _ = p.communicate(timeout=600)
            assert p.returncode == 0, out[-3000:]
            assert f"process {i} of 2: its devices at mesh pipeline {i}, fsdp 0-3\n" in out, out[-3000:]
    finally:  # a failure above leaves no process behind
        for p in two:
            if p.poll() is None:
                p.kill()
    got = losses("two")
    schedule = lambda run: json.loads((tmp_path / run / "run.json").read_text())["train"]["schedule"]  # noqa: E731
    assert (schedule("two"), schedule("one")) == ("1f1b", "gpipe")
    assert [s for s, _ in got] == [1, 2, 3, 4]
    np.testing.assert_allclose([x for _, x in got], [x for _, x in first], rtol=1e-5)
