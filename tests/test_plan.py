"""zoo.plan: the estimate against XLA's own figures, the planner's budgets, its errors, and the
big plans (abstract: no arrays, seconds).

``measure`` compiles the training step on the 8 simulated CPU devices (nothing is run, so the
host-memory programs here need no fresh process); XLA:CPU has one memory, so its figures are
compared with ``estimate(..., unified_memory=True)``.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import pytest
from test_placement import FAST

from zoo import plan, registry
from zoo.errors import ConfigError, MeshError

TOLERANCE = 0.10


def config(model_type: str, name: str = "small"):
    return registry.by_model_type(model_type).config_cls.preset(name, model_type)


# (model type, global batch, seq len, placement, mesh, parameters, optimizer state): every family
# on one device and on an 8-device mesh, maps from none to full remat, trees on device and host.
# Every family, one device and 8, maps with and without offloading, parameters / optimizer state
# on device and on host (the wider grid in docs/planning.md was measured once; each point here
# is a compile of the whole step, and the suite has 15 minutes).
GRID = [
    ("llama", 8, 128, "offload_attn", "data=2,fsdp=4", "device", "pinned_host"),
    ("qwen3", 4, 128, None, None, "device", "device"),
    ("deepseek_v3", 2, 128, "nvidia_offload", None, "pinned_host", "device"),
    # Expert parallelism: tokens exchanged all-to-all, the experts split over "expert". At 256
    # tokens: the walk was 21.6% under before it modelled XLA's CSE of the one dense layer's
    # recomputed forward pass and its early zero-initialised loop state (+4.9% now; 64 tokens
    # hid it, -4.4%: docs/planning.md, "Caveats").
    ("deepseek_v3", 8, 256, "remat", "fsdp=2,expert=4", "device", "device"),
    # The default (capacity) expert kernel under FSDP: its backward's overflow branch adds the
    # overflow's weight gradients in place into the batched pass's (30% over before that was
    # modelled). (The tile-loop kernel, `grouped`, is within 5% here too: docs/planning.md.)
    ("qwen3_moe", 8, 64, "remat", "fsdp=8", "device", "pinned_host"),
    # A pipeline: every tick of the GPipe schedule keeps its named tensors (4 stages, 4
    # micro-batches: 7 ticks of 1 row, the bubble's included), the liveness walk sees them all.
    ("llama", 8, 128, "device", "pipeline=4,data=2", "device", "device"),
]


@pytest.mark.parametrize("case", GRID, ids=[f"{c[0]}-{c[3]}-{c[4] or '1dev'}-{c[5][:3]}{c[6][:3]}" for c in GRID])
def test_estimate_is_within_10_percent_of_xla(case):
    model_type, batch, seq, placement, mesh, params, opt = case
    kw = {"batch_size": batch, "seq_len": seq, "placement": placement, "mesh": mesh, "param_memory": params,
          "opt_memory": opt}  # fmt: skip
    got = plan.measure(config(model_type), compiler_options=FAST, **kw)
    est = got.predicted  # the estimate of the same traced program, counted as XLA:CPU counts
    assert est.source == "estimate" and "one memory" in est.notes[0]
    err = est.device_bytes / got.device_bytes - 1
    assert abs(err) <= TOLERANCE, (case, est.device_bytes, got.device_bytes, err)
    # The exact parts: parameters and optimizer state per device under the mesh's layout.
    assert est.params == got.params and est.optimizer == got.optimizer
    named = {n for n, (d, h) in est.residuals.items() if d or h}
    assert "layer_input" in named


def test_a_map_keeping_expert_rows_counts_every_block_of_experts(monkeypatch):
    """Gathered a block of experts at a time (``fsdp=8``, four blocks: ``zoo.layers.moe``), a map
    that keeps ``moe_gate`` saves every block's rows: the estimate counts each iteration of the
    blocks' loop (it counted one, and priced MaxText's DeepSeek-V3 on 512 TPU v5p at 79 GiB a
    chip where the traced step held 286). (The liveness walk of this step is 15% under XLA:CPU's
    compiled figure, the small preset's one dense layer's merged gathers, not the blocks:
    docs/planning.md.)"""
    from zoo.layers import moe
    from zoo.layers.capacity_mlp import capacity_for

    cfg = config("deepseek_v3")
    e, k, m, d = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
    monkeypatch.setattr(moe, "EXPERT_BLOCK_BYTES", 3 * e * d * m * 4 // 4)  # float32: four blocks
    kw = {"batch_size": 8, "seq_len": 64, "placement": "remat+moe_gate=device", "mesh": "fsdp=8"}
    pairs = 8 * 64 // 8 * k  # a device's (token, expert) pairs
    slots = e * capacity_for(-(-pairs // 4), e // 4)  # each block's experts' slots, all blocks
    layers = cfg.num_layers - cfg.first_k_dense_replace
    assert plan.estimate(cfg, **kw).residuals["moe_gate"] == (layers * slots * m * 4, 0)


def test_a_one_layer_stage_counts_its_names_whatever_loops_its_layer_runs(monkeypatch):
    """Three MoE layers on three pipeline stages: each stage's stack is one layer, and the loop
    over blocks of experts inside it is not the stage's length. The saved layer inputs do not
    depend on how many blocks the experts are gathered in (with four, they were counted as four
    layers' and one layer's ``moe_gate`` as one block's)."""
    from zoo.layers import moe

    cfg = config("deepseek_v3")
    e, m, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    kw = {"batch_size": 12, "seq_len": 64, "placement": "remat+moe_gate=device", "mesh": "pipeline=3,fsdp=2"}
    got = {}
    for blocks in (1, 4):
        monkeypatch.setattr(moe, "EXPERT_BLOCK_BYTES", 3 * e * d * m * 4 // blocks)
        got[blocks] = plan.estimate(cfg, **kw).residuals
    assert got[4]["layer_input"] == got[1]["layer_input"]
    assert got[4]["moe_gate"][0] > got[1]["moe_gate"][0]  # four blocks' slots (1.25x the pairs), not one's


def test_a_model_with_bfloat16_parameters_plans():
    """Parameters stored in bfloat16 (a checkpoint loaded as it is published): half the bytes
    of float32's, moments of their dtype (planning one failed in the optimizer's labels: NumPy
    calls a bfloat16 array not floating)."""
    import jax.random as jr

    import zoo

    cfg = config("llama")
    kw = {"batch_size": 2, "seq_len": 64}
    half = zoo.Llama(cfg, key=jr.key(0), param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    full = zoo.Llama(cfg, key=jr.key(0), compute_dtype=jnp.bfloat16)
    got, ref = plan.estimate(half, **kw), plan.estimate(full, **kw)
    assert got.params * 2 == ref.params and got.optimizer == pytest.approx(ref.optimizer / 2, abs=64)


def test_a_lora_step_is_estimated_within_10_percent_of_xla():
    """An adapted model (``zoo.lora``) plans as its base does: optimizer state for the adapters
    only, the step's peak within the tolerance of XLA:CPU's. With a head of 32,768 rows, as
    large as the layers (the frozen head and embedding were counted as copies behind their
    ``stop_gradient``, and the step kept the frozen model's zero gradients: +15%)."""
    import jax.random as jr

    import zoo
    from zoo import lora

    base = zoo.Llama(dataclasses.replace(config("llama"), vocab_size=32768), key=jr.key(0))
    model = lora.init(base, lora.LoraConfig(r=8, alpha=16, targets=("all-linear",)), key=jr.key(1))
    got = plan.measure(model, batch_size=4, seq_len=128, placement="remat", compiler_options=FAST)
    est = got.predicted
    assert abs(est.device_bytes / got.device_bytes - 1) <= TOLERANCE, (est.device_bytes, got.device_bytes)
    adapters = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.adapters))
    assert est.optimizer == pytest.approx(2 * adapters, abs=64)  # Adam's two moments, adapters only
    assert est.gradients == adapters  # the frozen base gets none (the table said all parameters' until 2026-12-07)
    # On a mesh (as training runs it): the base split over fsdp, and each adapter as its weight:
    # the side whose features are the model width D (A's in, B's out) split over fsdp, the
    # other (heads x head size, the MLP's hidden units: tensor's) whole; their moments the same.
    split = plan.estimate(model, batch_size=8, seq_len=64, mesh="fsdp=8")
    base_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(base))
    d_in = ("layers.attn.wq", "layers.attn.wk", "layers.attn.wv", "layers.mlp.w_gate", "layers.mlp.w_up")
    mine = sum(a.a.nbytes // 8 + a.b.nbytes if path in d_in else a.a.nbytes + a.b.nbytes // 8
               for path, a in model.adapters.items())  # fmt: skip
    assert mine < 0.7 * adapters  # (was all of them before 2026-12-07)
    assert split.params == base_bytes // 8 + mine
    assert split.optimizer == pytest.approx(2 * mine, abs=64)
    assert split.gradients == mine


def test_estimate_is_abstract_and_splits_the_model():
    """A 405B model on a 72-device mesh, from shapes alone: parameters and optimizer state per
    device are the layout's exactly, the offloaded residuals are on host, and nothing is
    allocated (no 72 devices exist here)."""
    cfg = config("llama", "llama3.1-405b")
    t = time.perf_counter()
    est = plan.estimate(cfg, batch_size=72, seq_len=8192, placement="offload_attn", mesh="data=9,fsdp=8",
                        compute_dtype=jnp.bfloat16)  # fmt: skip
    assert time.perf_counter() - t < 60
    assert est.params == pytest.approx(cfg.num_params() * 4 / 8, rel=1e-3)  # float32, split over fsdp only
    assert est.optimizer == pytest.approx(2 * est.params, rel=1e-3)
    d, h = est.residuals["layer_input"]
    assert d == 0 and h == 126 * 8192 * 16384 * 2  # bf16 [1, S, D] per layer, on host
    assert est.residuals["mlp_gate"][0] == 126 * 8192 * 53248 * 2 and est.host_bytes >= est.residual_host


def test_plan_fits_every_budget_between_full_remat_and_everything_on_device():
    """On this CPU (one memory: remat only), budgets between the full-remat and the all-device
    peaks give a map whose measured peak fits and whose modelled step time is no worse than
    full remat's; the table lists every candidate."""
    cfg = config("llama")
    kw = {"batch_size": 8, "seq_len": 128}
    measured = plan.measure(cfg, placement="remat", compiler_options=FAST, **kw)
    low = measured.device_bytes
    high = plan.measure(cfg, placement="device", compiler_options=FAST, **kw).device_bytes
    assert high > 1.3 * low
    # Compiled for given devices (a TPU topology's, where the benchmarks compile ahead of time):
    # here another CPU device, the same program; XLA's own peak comes with it.
    there = plan.measure(cfg, placement="remat", compiler_options=FAST, devices=jax.devices()[3:], **kw)
    assert there.device_bytes == low and there.peak_bytes == measured.peak_bytes > 0
    with pytest.raises(MeshError, match=r"mesh fsdp=8 has 8 devices; 4 are present to compile for"):
        plan.measure(cfg, placement="remat", mesh="fsdp=8", devices=jax.devices()[:4], **kw)
    for frac in (0.25, 0.75):
        budget = low + frac * (high - low)
        p = plan.plan(cfg, device_budget=budget, hardware="cpu", **kw)
        got = plan.measure(cfg, placement=p.placement, compiler_options=FAST, **kw)
        assert got.device_bytes <= budget, (frac, got.device_bytes, budget)
        remat = next(c for c in p.candidates if c.label == "full remat")
        assert p.step_time <= remat.step_time * (1 + 1e-9) and p.batch_size == 8
        assert p.placement.placed("pinned_host") == ()  # nothing to offload to on one memory
    assert p.step_time < remat.step_time and p.placement != p.placement.preset("remat")
    labels = [c.label for c in p.candidates]
    assert labels[:2] == ["no map", "full remat"] and labels[-1] == "plan" and "preset save_matmuls" in labels
    assert "full remat" in str(p) and "MFU" in str(p) and p.placement.spec() in str(p)


def test_big_plan_offloads_on_gb200_and_checks_the_cuda_export():
    """Llama 3.1 405B on 64 GB200s at 8K tokens: planned from shapes in seconds; what it
    offloads really moves to host in the CUDA program."""
    # (Its wall time, ~35 s on the 2-core CPU with the network priced, is a figure for docs/planning.md,
    # not a test: under a loaded machine a timed assertion fails for no fault of the planner.)
    p = plan.plan(config("llama", "llama3.1-405b"), seq_len=8192, mesh="fsdp=8,tensor=8", hardware="gb200",
                  compute_dtype=jnp.bfloat16)  # fmt: skip
    assert p.estimate.device_bytes <= p.device_budget and p.estimate.host_bytes <= p.host_budget
    assert p.placement.placed("pinned_host") and set(p.offloaded_verified) == set(p.placement.placed("pinned_host"))
    remat = next(c for c in p.candidates if c.label == "full remat")
    assert p.tokens_per_s > remat.tokens_per_s


def test_nothing_fits_names_the_smallest_peak_and_what_dominates_it():
    with pytest.raises(ConfigError, match=r"smallest peak found is .* the largest part is optimizer state") as e:
        plan.plan(config("llama", "llama3.1-405b"), seq_len=8192, mesh="data=9,fsdp=8", hardware="gb200",
                  compute_dtype=jnp.bfloat16)  # fmt: skip
    assert isinstance(e.value, plan.NothingFits) and all(c.batch_size is None for c in e.value.candidates)
    assert "full remat" in plan.candidate_table(e.value.candidates)


def test_errors_name_the_culprit():
    with pytest.raises(ConfigError, match=r"unknown hardware 'h300' \(did you mean 'h200'\?\); known: h100, h200"):
        plan.hardware("h300")
    with pytest.raises(MeshError, match=r"num_kv_heads = 4 is not divisible by mesh axis 'tensor' of size 8"):
        plan.estimate(config("llama"), batch_size=8, seq_len=64, mesh="tensor=8")
    with pytest.raises(MeshError, match="batch size 6 is not divisible"):
        plan.estimate(config("llama"), batch_size=6, seq_len=64, mesh="fsdp=4")
    with pytest.raises(MeshError, match="not divisible"):
        plan.plan(config("llama", "llama3.1-405b"), seq_len=8192, mesh="fsdp=72", hardware="gb200")


def test_hardware_table_has_sources():
    for name in ("h100", "h200", "b200", "gb200", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        hw = plan.hardware(name)
        assert hw.source and hw.hbm_bytes > 0 and hw.peak_flops > 0 and hw.host_link > 0 and hw.host_bytes > 0
    assert "900 GB/s" in plan.hardware("gb200").source
    assert plan.hardware("GB200") is plan.hardware("gb200") and plan.hardware("v5p").name == "tpu-v5p"
    assert plan.hardware("v5e").name == "tpu-v5e"


def test_recipe_plans_and_says_when_nothing_fits(capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("plan_recipe", Path(__file__).parents[1] / "recipes" / "plan.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    assert recipe.main(["--model", "llama", "--preset", "small", "--seq-len", "128", "--device-budget-gib", "0.1",
                        "--compute-dtype", "float32"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "full remat" in out and "chosen: batch" in out
    assert recipe.main(["--preset", "small", "--seq-len", "128", "--hardware", "tpu-v9"]) == 2
    assert "unknown hardware 'tpu-v9'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device-budget-gib", "-1"], "--device-budget-gib must be positive, got -1.0"),
        (["--device-budget-gib", "nan"], "--device-budget-gib must be positive, got nan"),
        (["--host-budget-gib", "-2"], "--host-budget-gib must be non-negative, got -2.0"),
        (["--batch-size", "0"], "--batch-size must be positive, got 0"),
        (["--devices", "8", "--top", "0"], "--top must be positive, got 0"),
        (["--domain", "0"], "--domain must be positive, got 0"),
        (["--hardware", "gb200", "--domain", "80"], "--domain must be at most gb200's 72 devices a fast domain, got 80"),
    ],
)
def test_recipe_refuses_bad_flags_naming_them(flags, message, capsys):
    """#42.9: the recipe's budgets, batch and --top are checked before planning, one line naming the flag."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("plan_recipe", Path(__file__).parents[1] / "recipes" / "plan.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with pytest.raises(SystemExit) as e:
        recipe.main(["--preset", "small", "--seq-len", "32", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_no_candidate_in_the_table_beats_the_plan():
    """#42.15: the table priced its rows at the full budget, the plan within it less the margin:
    Llama small at 0.1 GiB listed save_matmuls at batch 5 (102.0 MiB of 102.4, 4,804 tokens/s)
    over the plan's 4,696. Every row that fits is now one the plan could have chosen."""
    p = plan.plan(registry.by_model_type("llama").config_cls.preset("small", "llama"), seq_len=128,
                  device_budget=0.1 * 2**30, compute_dtype=jnp.float32, verify=False)  # fmt: skip
    usable = p.device_budget * 0.9
    for c in p.candidates:
        if c.batch_size:
            assert c.device_bytes <= usable and c.tokens_per_s <= p.tokens_per_s * (1 + 1e-9), c.label


def test_when_the_trace_refuses_every_choice_the_error_says_so(monkeypatch):
    """#42.5: where the cost model's choices keep failing their traced estimate, "nothing fits"
    compared a 14.7 MiB peak with 74.5 GiB budgets; the error now names what failed."""
    import dataclasses

    from zoo.plan import mesh_plan

    real = mesh_plan._from_step

    def estimate(step, unified, jaxpr=None):
        e = real(step, unified=unified, jaxpr=jaxpr)
        return e if jaxpr is not None else dataclasses.replace(e, device_bytes=e.device_bytes + 2**40)

    monkeypatch.setattr(mesh_plan, "_from_step", estimate)
    with pytest.raises(plan.NothingFits, match=r"nothing fits as verified: the cost model's choice at local batch \d+ "
                       r"priced .* but its traced step needs \d+\.\d GiB"):  # fmt: skip
        plan.plan(registry.by_model_type("llama").config_cls.preset("tiny", "llama"), seq_len=16, batch_size=1,
                  hardware="h100", verify=False)  # fmt: skip


def test_a_layers_flops_are_its_matmuls_with_attention_causal_whatever_the_width():
    """One Llama layer's forward FLOPs as the cost model counts them: every projection in full and
    attention's two matmuls at half (the causal mask), on a model whose width equals the sequence
    length and whose grouped queries fold the sequence into a larger dimension (a projection's
    [S, D] input has two dims of size S there: once counted at half). FP8 products are the
    precision map's tensorwise projections; its MXFP8 ones are block-scaled FP8 products, counted
    as FP8 only for hardware that runs them so (``block=True``)."""
    from zoo.plan import _flops
    from zoo.plan._step import abstract_model

    c = dataclasses.replace(registry.by_model_type("llama").config_cls.preset("tiny", "llama"), hidden_size=256,
                            intermediate_size=512, num_heads=8, num_kv_heads=2, head_dim=32, num_layers=2)  # fmt: skip
    s, d, h, g, k, f = 256, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    linear = 2 * s * (d * (h + 2 * g) * k + h * k * d + 3 * d * f)
    attention = 2 * 2 * s * s * h * k / 2
    (body,) = _flops.layer_bodies(abstract_model(c, jnp.bfloat16), s, "fp8_all+mlp_down=none")
    assert body.layers == 2
    assert body.forward_flops() == linear + attention
    assert body.fp8_flops() == linear - 2 * s * f * d
    (mixed,) = _flops.layer_bodies(abstract_model(c, jnp.bfloat16), s, "mxfp8+mlp_down=tensorwise+query=none")
    assert mixed.forward_flops() == linear + attention
    assert mixed.fp8_flops() == 2 * s * f * d
    assert mixed.fp8_flops(block=True) == linear - 2 * s * d * h * k


def test_fp8_matmuls_are_priced_at_the_hardwares_fp8_peak():
    """``precision=``: the step's FP8 products run at the FP8 peak (twice bf16's on H100), so its
    compute takes ``1 - s + s/2`` of the bf16 step's, ``s`` their share of the model's FLOPs; on TPU
    v5p, with no FP8 unit, the price does not move. MXFP8's block-scaled products run at the FP8
    peak on Blackwell (GB200) only: on H100 XLA runs them as dequantized products, priced as bf16's.
    A bad map names the culprit."""
    c = dataclasses.replace(registry.by_model_type("llama").config_cls.preset("tiny", "llama"), hidden_size=256,
                            intermediate_size=512, num_heads=8, num_kv_heads=2, head_dim=32, num_layers=2)  # fmt: skip
    kw = dict(seq_len=256, batch_size=64, compute_dtype=jnp.bfloat16)  # one device: compute-bound
    faster = {("h100", "fp8_all"): True, ("tpu-v5p", "fp8_all"): False, ("gb200", "mxfp8"): True}
    # H100 prices MXFP8 as bf16: its layers' FP8 FLOPs leave the block-scaled ones out (the test above)
    assert not plan.hardware("h100").block_scaled_fp8 and plan.hardware("gb200").block_scaled_fp8
    for hw in ("h100", "tpu-v5p", "gb200"):
        bf16 = plan.price(c, {"remat": "remat"}, hardware=hw, **kw)[0]
        for (_, spec), fast in ((k, v) for k, v in faster.items() if k[0] == hw):
            fp8 = plan.price(c, {"remat": "remat"}, hardware=hw, precision=spec, **kw)[0]
            assert (fp8.step_time < 0.9 * bf16.step_time) if fast else fp8.step_time == bf16.step_time, (hw, spec)
    with pytest.raises(ConfigError, match="did you mean 'mlp_up'"):
        plan.price(c, {"remat": "remat"}, hardware="h100", precision="mlp_u=tensorwise", **kw)


def _walk_and_xla(f, *args) -> tuple[int, int]:
    """The liveness walk's device temporaries of ``f`` and XLA:CPU's (the compiled program's)."""
    from zoo.plan import _liveness

    walk, _ = _liveness.program_peak(jax.make_jaxpr(f)(*args))
    return walk.device, jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_the_walk_drops_a_loop_bodys_dead_code_as_xla_does():
    """Work a ``while`` body computes and nothing reads, a collective included (a MoE dispatch's
    later rounds computed their output in their backward loop and sent it back, unread), is gone
    from XLA's compiled program (XLA:TPU's too, checked ahead of time for 8 v5e chips; jax 0.10
    lowers it, 0.12 drops it itself); the walk no longer counts it (it counted the dead [N, N]
    products: 2x N² floats more than now, where XLA:CPU keeps none of them)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, mesh = 512, jax.make_mesh((8,), ("x",))

    def body(i, c, w):
        dead = jnp.tanh(c @ w) @ w
        jax.lax.all_to_all(dead, "x", 0, 0, tiled=True)  # dead too: its axis names are no effect
        return c * 1.0001

    def f(x, w, trips):
        loop = jax.shard_map(lambda x, w, t: jax.lax.fori_loop(0, t, lambda i, c: body(i, c, w), x), mesh=mesh,
                             in_specs=(P("x"), P(), P()), out_specs=P("x"))  # fmt: skip
        return loop(x, w, trips)

    args = jax.device_put(jnp.ones((8 * n, n)), NamedSharding(mesh, P("x"))), jnp.ones((n, n)), jnp.int32(3)
    compiled = jax.jit(f).lower(*args).compile().as_text()
    assert "all-to-all" not in compiled and " dot(" not in compiled
    walk, xla = _walk_and_xla(f, *args)
    assert xla < n * n * 4 and walk < 3 * n * n * 4, (walk, xla)  # was 4 N² floats


def test_a_cast_read_by_a_conditional_through_a_reshape_is_materialised_in_its_own_dtype():
    """A float32 product cast to bfloat16 and reshaped for a conditional's operand is materialised
    as the bfloat16 rows (XLA computes a conditional's operands first), so the float32 product
    dies at the cast; the walk held it through the conditional (2.5x XLA:CPU's temporaries,
    1.5x now: the branch's own float32 intermediate, which XLA fuses)."""

    def f(a, b, flag):
        y = jnp.einsum("ij,jk->ik", a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16).reshape(-1)

        def overflow(y):
            big = jnp.sin(y.astype(jnp.float32)) * 2
            return (big + jnp.cos(big)).astype(jnp.bfloat16)

        return jax.lax.cond(flag, overflow, lambda y: y, y)

    walk, xla = _walk_and_xla(f, jnp.ones((1024, 256), jnp.bfloat16), jnp.ones((256, 1024), jnp.bfloat16), True)
    assert walk <= 1.6 * xla, (walk, xla)
