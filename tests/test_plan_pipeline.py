"""zoo.plan with a pipeline axis: the cost model's bubble and hand-overs, the saved ticks in the
traced memory, and the search choosing a pipeline over a slow link (abstract: no arrays)."""

from __future__ import annotations

import dataclasses

import pytest

from zoo import parallel, plan, registry
from zoo.plan import collectives
from zoo.plan._step import make_step
from zoo.plan.planner import cost_model


def config(model_type: str, name: str = "tiny"):
    return registry.by_model_type(model_type).config_cls.preset(name, model_type)


def test_the_bubble_scales_the_pipelined_layers_compute_exactly():
    """Llama tiny (2 layers) on 2 stages, one layer each: a device runs its stage's layer on
    b + 1 one-row micro-batches (the layers' share of the FLOPs times (M + P - 1) / M, M = b)
    and half the head (the stages split the vocabulary); useful FLOPs (MFU's) exclude the bubble."""
    one = cost_model(config("llama"), seq_len=64, hardware="h100")
    two = cost_model(config("llama"), seq_len=64, mesh="pipeline=2", hardware="h100")
    stages, layers = 2, two.pipelined_flops  # a sequence's training FLOPs in the layer stack
    assert one.pipelined_flops == 0 and 0 < layers < one.compute_flops(1) and two.whole_flops == 0
    head = one.compute_flops(1) - layers  # the head (the lookup is free)
    assert two.head_flops == pytest.approx(head) and two.head_stages == stages
    for b in (1, 3, 8):
        m = two.microbatches(b)
        assert m == b and two.bubble(b) == (stages - 1) / (m + stages - 1)
        expected = head / stages * b + layers / stages * b * (m + stages - 1) / m
        assert two.compute_flops(b) == pytest.approx(expected, rel=1e-12)
        # Useful FLOPs per device (MFU's numerator) are the model's share, the bubble not counted.
        assert two.time(None, b, "device", "device")[1] == pytest.approx(one.compute_flops(b) / stages)
    assert one.microbatches(4) is None and one.bubble(4) == 0.0


def test_dense_first_layers_and_mtp_are_not_pipelined():
    """DeepSeek-V3 tiny (1 dense layer, 2 MoE layers): only the MoE stack runs in stages."""
    cm = cost_model(config("deepseek_v3"), seq_len=32, mesh="pipeline=2", hardware="h100")
    staged = {b.layers: cm._pipelined(b) for b in cm.bodies}
    assert staged == {1: False, 2: True}, staged
    assert cm.whole_flops > 0 and cm.pipelined_flops > cm.whole_flops  # the dense layer runs on both stages
    dense, moe = sorted(cm.bodies, key=lambda b: b.layers)
    assert cm._work(dense, 5) == (1, 5) and cm._work(moe, 5) == (1, 6)  # 1 of 2 MoE layers per stage, b + 1 rows


def test_the_hand_overs_are_two_rows_per_tick_on_the_link_the_pipeline_crosses():
    """Per device per step: 2 (M + P - 1) one-row activations handed on (forward, and their
    gradients back). All-reduced over pipeline: b rows each for the last stage's output (the
    broadcast), the embedding's lookups, the head's feature gradients (the stages split the
    vocabulary) and the stages' shared input's gradient; the cost model's curve through three
    traces gives the traced step's bytes at batches it did not trace. On 16 H100s the pipeline
    axis (outermost) crosses nodes."""
    seq, d, item, stages = 64, 64, 4, 2  # Llama tiny: hidden 64, float32
    mesh = "pipeline=2,data=8"
    cm = cost_model(config("llama"), seq_len=seq, mesh=mesh, hardware="h100")
    row = seq * d * item
    for b in (1, 4, 6):
        ticks = cm.microbatches(b) + stages - 1
        p2p, reduced = cm.pipeline_bytes(b)
        assert p2p == 2 * ticks * row, (b, p2p)
        assert 0 <= reduced - 4 * b * row < row / 4, (b, reduced)  # and the log-sum-exp merges
        step = make_step(config("llama"), batch_size=8 * b, seq_len=seq, mesh=mesh, placement="remat", microbatches=b)
        traced = collectives.totals(collectives.traced(step.trace(), step.sizes))
        assert p2p == traced[("permute", ("pipeline",))]
        assert reduced == pytest.approx(traced[("all_reduce", ("pipeline",))])
    h100 = plan.hardware("h100")
    bandwidth = cm.traffic.bandwidth
    assert bandwidth[("pipeline",)] == h100.cross_link and bandwidth[("data",)] == h100.domain_link
    # A permute sends its buffer once; both wait in the step (exposed), on the cross-node link.
    assert collectives.seconds("permute", p2p, stages, h100.cross_link) == p2p / h100.cross_link
    cm.time(None, 6, "device", "device")
    pipeline = p2p / h100.cross_link + collectives.seconds("all_reduce", reduced, stages, h100.cross_link)
    assert cm.comm[(None, 6, "device", "device")] >= pipeline > 0


def test_every_tick_is_saved_and_the_model_follows_the_estimate():
    """GPipe keeps every tick's tensors for the backward pass, the bubble's too: (M + P - 1)
    micro-batches of rows / M. The cost model's memory follows the traced estimate's."""
    cfg, seq, d = config("llama", "small"), 64, 256  # 4 layers: 2 per stage
    for m, ticks in ((2, 3), (1, 2)):  # 2 rows per device: 2 micro-batches of 1, or 1 of 2
        est = plan.estimate(cfg, batch_size=8, seq_len=seq, mesh="pipeline=2,data=4", placement="device",
                            microbatches=m)  # fmt: skip
        saved = est.residuals["layer_input"]
        assert saved == (ticks * 2 * (2 // m) * seq * d * 4, 0), (m, saved)
    cm = cost_model(cfg, seq_len=seq, mesh="pipeline=2,data=4", hardware="cpu")
    device = cm.map_cls.preset("device")
    for b in (2, 6):
        got = plan.estimate(cfg, batch_size=4 * b, seq_len=seq, mesh="pipeline=2,data=4", placement="device",
                            microbatches=b, unified_memory=True).device_bytes  # fmt: skip
        assert abs(cm.memory(device, b, "device", "device")[0] / got - 1) < 0.1, (b, got)


def test_the_search_pipelines_over_a_slow_link():
    """Two fast domains of 4 devices joined by a slow link: every mesh of 8 without a pipeline
    sends weights or gradients over it; 2 stages send only one-row activations, and win."""
    hw = dataclasses.replace(plan.hardware("cpu"), name="cpu-two-domains", domain=4, cross_link=1e6)
    kw = {"seq_len": 32, "hardware": hw, "batch_size": 4, "device_budget": 0.2 * 2**30}
    p = plan.plan(config("llama", "small"), devices=8, top=1, **kw)
    sizes = parallel.parse_mesh(p.mesh)
    m = 4 // (sizes["data"] * sizes["fsdp"] * sizes["expert"])  # one-row micro-batches: the device's rows
    assert sizes["pipeline"] == 2 and p.microbatches == m and p.bubble == pytest.approx(1 / (m + 1))
    assert any(r.mesh and "pipeline" not in r.mesh for r in p.meshes)  # the others were listed
    flat = plan.plan(config("llama", "small"), mesh="fsdp=2,tensor=4", **kw)
    assert p.tokens_per_s > 5 * flat.tokens_per_s
