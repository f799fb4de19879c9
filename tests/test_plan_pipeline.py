"""zoo.plan with a pipeline axis: the cost model's bubble and hand-overs, the saved ticks in the
traced memory, the search choosing a pipeline over a slow link, and the interleaved schedule's
virtual stages priced and chosen (abstract, but for one compile on the 8 CPU devices)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from test_placement import FAST

from zoo import parallel, plan, registry
from zoo.errors import ConfigError, MeshError
from zoo.plan import collectives, mesh_plan
from zoo.plan._step import make_step
from zoo.plan.costs import virtual_choices
from zoo.plan.planner import cost_model


def config(model_type: str, name: str = "tiny"):
    return registry.by_model_type(model_type).config_cls.preset(name, model_type)


@functools.cache
def small(mesh: str):
    """Llama small's cost model (4 layers: 2 per stage on 2 stages) at 64 tokens, shared by the tests."""
    return cost_model(config("llama", "small"), seq_len=64, mesh=mesh, hardware="cpu")


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
    cm = small("pipeline=2,data=4")
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


def test_interleaving_divides_the_bubble_and_multiplies_the_hand_overs():
    """V virtual stages: V·M + P - 1 ticks, each of a chunk of L/(P·V) layers on one row. The
    pipelined layers' compute is their share times (V·M + P - 1)/(V·M), the hand-overs
    2 (V·M + P - 1) rows; derived from GPipe's traces, every collective equals the interleaved
    step's own traced bytes (FSDP's forward gathers, hoisted out of GPipe's tick loop, run at
    every tick of the chunk there). V must divide the stage's 2 layers, M be a multiple of P."""
    seq, row, stages, virtual = 64, 64 * 256 * 4, 2, 2
    mesh = "pipeline=2,fsdp=2,data=2"
    cm = small(mesh)
    head, layers = cm.head_flops, cm.pipelined_flops
    assert [cm.virtual_stages(b) for b in (1, 2, 3, 4)] == [[1], [1, 2], [1], [1, 2]]
    for b in (2, 4):
        m, ticks = b, virtual * b + stages - 1
        assert cm.bubble(b, virtual) == (stages - 1) / ticks < cm.bubble(b) == (stages - 1) / (m + stages - 1)
        expected = head / stages * b + layers / stages * b * ticks / (virtual * m)
        assert cm.compute_flops(b, virtual) == pytest.approx(expected, rel=1e-12) and expected < cm.compute_flops(b)
        p2p, reduced = cm.pipeline_bytes(b, virtual)
        assert p2p == 2 * ticks * row and reduced == cm.pipeline_bytes(b)[1]
        step = make_step(config("llama", "small"), batch_size=4 * b, seq_len=seq, mesh=mesh, placement="remat",
                         microbatches=b, virtual_stages=virtual)  # fmt: skip
        traced = collectives.totals(collectives.traced(step.trace(), step.sizes))
        scale = collectives.interleaved(m, stages, virtual)
        assert {k: cm.traffic.bytes(b, *k, scale) for k in traced} == pytest.approx(traced, rel=1e-9), b
    assert cm.time(None, 4, "device", "device", virtual)[0] < cm.time(None, 4, "device", "device")[0]
    with pytest.raises(ConfigError, match=r"virtual_stages=2 cannot run at 3 rows .* possible here: \[1\]"):
        cm.check_virtual(3, 2)


def test_interleaved_memory_follows_xla():
    """Every tick saves a chunk of its stage's layers on one row (the bubble's ticks, and the
    backward tick's copy, of a chunk: the named tensors' fixed part / V); each tick picks its
    chunk's weights inside the layer's checkpoint, so they are picked again in the backward pass,
    not saved per tick, and GPipe's hoisted copy of the stage's weights is not made: the cost
    model's peak is within 1% of XLA's compiled step on 8 CPU devices (Llama small,
    pipeline=2,data=4, 4 one-row micro-batches), below GPipe's. (Picked outside the checkpoint,
    the step saved (V·M + P - 1)/V copies of the stage's weights: 60.9 MB against GPipe's 38.8.)"""
    cm = small("pipeline=2,data=4")
    c = config("llama", "small")
    layer = 4 * (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim
                 * c.hidden_size + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)  # fmt: skip
    assert cm.stage_weights == cm.hoisted == 2 * layer  # float32 compute: GPipe's copy is as large
    assert cm.interleaved_bytes(4, 2) == -2 * layer and cm.interleaved_bytes(4, 1) == 0
    remat = cm.map_cls.preset("remat")
    kw = {"batch_size": 16, "seq_len": 64, "mesh": "pipeline=2,data=4", "placement": "remat", "microbatches": 4}
    got = plan.measure(c, virtual_stages=2, compiler_options=FAST, **kw)
    gpipe = plan.measure(c, compiler_options=FAST, **kw)
    model = cm.memory(remat, 4, "device", "device", 2)[0]
    assert abs(model / got.device_bytes - 1) < 0.01, (model, got.device_bytes)
    assert got.device_bytes < gpipe.device_bytes - layer and model < cm.memory(remat, 4, "device", "device")[0] - layer
    # The liveness walk of the same program counts more than XLA keeps: each layer's picked
    # weights as a buffer of their own, which XLA fuses into their uses (10.4% over, measured).
    assert 1 < got.predicted.device_bytes / got.device_bytes < 1.11


def test_the_plan_interleaves_where_it_helps_and_says_so():
    """Llama small on pipeline=2,data=4 at 4 rows per device, on this CPU (compute-bound, links
    in RAM): 2 virtual stages cut the bubble from 1/5 to 1/9 of the ticks and the plan takes
    them, faster than the same map on GPipe's schedule (the table's preset rows, and what the
    planner planned before), and smaller (no copy of the stage's weights hoisted out of the
    ticks); the plan prints them for TrainConfig."""
    kw = {"seq_len": 64, "mesh": "pipeline=2,data=4", "batch_size": 16, "hardware": "cpu", "verify": False}
    p = plan.plan(config("llama", "small"), **kw)
    assert p.virtual_stages == 2 and p.microbatches == 4 and p.bubble == pytest.approx(1 / 9)
    said = "pipeline: microbatches=4 (TrainConfig.microbatches), virtual_stages=2 (TrainConfig.virtual_stages)"
    assert said in str(p)
    gpipe = next(c for c in p.candidates if c.label == "preset device")
    assert p.placement == gpipe.placement and gpipe.virtual_stages == 1 and p.candidates[-1].virtual_stages == 2
    assert p.step_time < 0.95 * gpipe.step_time and p.candidates[-1].device_bytes < gpipe.device_bytes
    # Given the batch and V, the preset rows run that schedule too (they were priced on GPipe's
    # order beside a plan on another, as --virtual-stages 4 showed for Megatron's DeepSeek-V3).
    fixed = plan.plan(config("llama", "small"), virtual_stages=2, **kw)
    assert {c.virtual_stages for c in fixed.candidates} == {2}
    assert next(c for c in fixed.candidates if c.label == "preset device").step_time < 0.95 * gpipe.step_time
    # The plan's cost model (its temporaries a line through local batches 1 and 4; this one's, 1 and 2).
    cm = small("pipeline=2,data=4")
    assert cm.memory(p.placement, 4, "device", "device", 2)[0] == pytest.approx(p.candidates[-1].device_bytes, rel=1e-3)
    _, b, _, _, v = mesh_plan._choose(cm, 4, gpipe.device_bytes, 0.0)
    assert (b, v) == (4, 2)


def test_virtual_stages_that_cannot_chunk_the_stage_are_never_chosen():
    """Llama tiny with 10 layers on 2 stages: 5 per stage, so V is 1, 2, 3 or 5 (chunks of 3 and
    2, of 2, 2 and 1, of one), never 4 (chunks of 2 would leave the fourth empty), and more
    than 1 only with M a multiple of P; the planner's choice takes 5, and asking for 4 names the rule."""
    cfg = dataclasses.replace(config("llama"), num_layers=10)
    cm = cost_model(cfg, seq_len=64, mesh="pipeline=2,data=4", hardware="cpu")
    assert [cm.virtual_stages(b) for b in (2, 3, 4, 6)] == [[1, 2, 3, 5], [1], [1, 2, 3, 5], [1, 2, 3, 5]]
    chosen = [mesh_plan._choose(cm, b, 2.0**30, 0.0)[-1] for b in (3, 4, 6)]  # (map, b, pm, om, V)
    assert chosen == [1, 5, 5] and cm.bubble(4, 5) == 1 / (5 * 4 + 1)
    assert mesh_plan._choose(cm, None, 2.0**30, 0.0, virtual=1)[-1] == 1  # plan(virtual_stages=1): GPipe's
    with pytest.raises(ConfigError, match=r"virtual_stages=4 cannot run at 4 rows per device on pipeline=2.*\[1, 2, 3, 5\]"):
        cm.check_virtual(4, 4)  # what plan(virtual_stages=4) and price(virtual_stages=4) raise
    # A short last chunk still costs a whole chunk's tick: 3 chunks of 2 layers for the 5.
    body = next(b for b in cm.bodies if cm._pipelined(b))
    assert cm._work(body, 4, 3) == (2, 3 * 4 + 1) and cm._work(body, 4, 5) == (1, 5 * 4 + 1)
    # From the configs alone: 405B's 126 layers on 16 stages are 8 per stage (padded); Qwen3
    # 235B-A22B's 94 MoE layers on 8 stages 12, its dense stack (no layers) aside.
    assert virtual_choices(config("llama", "llama3.1-405b"), 16, 48) == [1, 2, 3, 4, 8]
    assert virtual_choices(config("qwen3_moe", "qwen3-235b-a22b"), 8, 256) == [1, 2, 3, 4, 6, 12]
    assert virtual_choices(config("qwen3_moe", "qwen3-235b-a22b"), 8, 12) == [1]
    with pytest.raises(ConfigError, match=r"virtual_stages=3 needs a pipeline axis; the mesh 'one device' has none"):
        plan.price(cfg, {"remat": "remat"}, seq_len=64, batch_size=1, virtual_stages=3)
    # The step the planner compiles refuses it as the training step does (validate_mesh's chunks).
    with pytest.raises(MeshError, match="virtual_stages"):
        make_step(cfg, batch_size=8, seq_len=64, mesh="pipeline=2,data=4", microbatches=2, virtual_stages=4)


def test_1f1b_keeps_fewer_ticks_and_the_plan_takes_it_where_gpipe_does_not_fit():
    """The cost model prices 1F1B from GPipe's traces: at most 2P - 1 one-row micro-batches'
    saved tensors (a slot more, and the backward pass's copy of one) instead of M + P - 1, the
    same compute and hand-overs. Its memory follows the traced 1F1B step's (within 10% under full
    remat; Llama small, pipeline=2,data=4) and stays flat where GPipe's grows with the rows (at 16
    rows a device 1F1B holds more: a second float32 gradient of the stage's weights, the sum, which
    XLA allocates before the tick loop, against rows of a few kB each), and where a budget holds
    GPipe to a smaller batch the plan takes 1F1B's larger one, faster (less bubble), verified by
    the traced 1F1B step, and says so for TrainConfig."""
    cm, c = small("pipeline=2,data=4"), config("llama", "small")
    remat = cm.map_cls.preset("remat")
    one = cm.with_schedule("1f1b")
    got = plan.estimate(c, batch_size=64, seq_len=64, mesh="pipeline=2,data=4", placement="remat", microbatches=16,
                        schedule="1f1b", unified_memory=True).device_bytes  # fmt: skip
    assert abs(one.memory(remat, 16, "device", "device")[0] / got - 1) < 0.1, got
    assert one.time(remat, 16, "device", "device") == cm.time(remat, 16, "device", "device")
    assert one.memory(remat, 64, "device", "device")[0] < 1.01 * one.memory(remat, 16, "device", "device")[0]
    assert one.memory(remat, 64, "device", "device")[0] < cm.memory(remat, 64, "device", "device")[0]
    budget = 1.02 * cm.memory(remat, 32, "device", "device")[0] / 0.9  # GPipe fits 32 rows a device under full remat
    kw = {"seq_len": 64, "mesh": "pipeline=2,data=4", "hardware": "cpu", "verify": False, "device_budget": budget}
    best = plan.plan(c, **kw)
    gpipe = mesh_plan._choose(cm, None, 0.9 * budget, 0.0, 1)  # GPipe's best within the same budget
    assert best.schedule == "1f1b" and best.batch_size > 4 * gpipe[1]
    assert best.tokens_per_s > 4 * gpipe[1] * 64 / cm.time(*gpipe)[0]
    assert best.estimate.device_bytes <= 0.9 * budget and "schedule=1f1b (TrainConfig.schedule)" in str(best)


def test_1f1b_prices_the_forward_pass_a_whole_batch_total_needs():
    """Qwen3-MoE's balance loss takes the whole batch's expert loads (zoo.hooks.pipeline.stack_total),
    so 1F1B runs the stack's forward pass over the whole batch first: the cost model finds that in
    the traced step and prices the stage's layers 4 passes instead of 3; GPipe and Llama's 1F1B
    (no such total) are priced as before."""
    cfg = dataclasses.replace(config("qwen3_moe"), mlp_only_layers=())
    cm = cost_model(cfg, seq_len=32, mesh="pipeline=2", hardware="h100")
    one = cm.with_schedule("1f1b")
    assert cm.whole_pass and not small("pipeline=2,data=4").whole_pass
    (body,) = [b for b in cm.bodies if cm._pipelined(b)]
    for b in (2, 4):
        extra = body.forward_flops() * cm._work(body, b)[0] * cm._work(body, b)[1]
        assert cm.compute_flops(b) + extra == pytest.approx(one.compute_flops(b), rel=1e-12)
        assert one.time(None, b, "device", "device")[0] > cm.time(None, b, "device", "device")[0]
    llama = small("pipeline=2,data=4")
    assert llama.with_schedule("1f1b").compute_flops(4) == llama.compute_flops(4)
