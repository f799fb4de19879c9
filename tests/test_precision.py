"""Every family's precision map (``zoo.layers.precision``): one source of truth with the model
code, ``none`` is the model's own numerics bit for bit, FP8 maps train, bad maps are named.
The recipes' numerics against NumPy are ``test_fp8.py``'s."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FIXTURES
from families import CASES, MODEL_TYPES, tiny, tiny_ids
from test_placement import placement_annotations

import zoo
from zoo.errors import ConfigError
from zoo.layers import fp8
from zoo.layers.precision import PrecisionError, precision_map_for, resolve, using
from zoo.llama import preset as llama_preset
from zoo.train import TrainConfig, make_train_step, optimizer
from zoo.train.setup import check_model


def lm(model, ids):
    return zoo.lm_loss(model, ids)


def lm_in(spec):
    """The loss with precision ``spec``, entered inside the traced function (jit caches a trace by
    its arguments, not by the active map)."""

    def f(model, ids):
        with using(spec, model):
            return zoo.lm_loss(model, ids)

    return f


# Beside the shared fixture, those that run a family's other matmuls (DeepSeek-V3's MTP block,
# Qwen3's MoE layers).
MORE = {"deepseek_v3": ("deepseek_v3-tiny-16e-mtp", {"mtp": True}), "qwen3": (CASES["qwen3_moe"], {})}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_map_names_exactly_the_matmuls_the_model_code_asks_for(model_type, monkeypatch):
    models = [tiny(model_type)]
    if model_type in MORE:
        name, options = MORE[model_type]
        models.append(zoo.from_pretrained(FIXTURES / name, **options))
    ids = tiny_ids(model_type)
    asked: list[str] = []
    real = fp8.recipe_of
    monkeypatch.setattr(fp8, "recipe_of", lambda name: asked.append(name) or real(name))
    for model in models:
        with using("fp8_all", model):  # the training loss, every block in it
            jax.eval_shape(jax.value_and_grad(lambda m, i: m.loss(i)[0]), model, ids)
    assert set(asked) == set(precision_map_for(models[0]).names())
    # The parameter description names the product that reads a weight (Param.matmul: LoRA
    # dropout's term goes there): each such name is one the model code asks for.
    named_by_params = {p.matmul for m in models for p in type(m).param_specs(m.config).values() if p.matmul}
    assert named_by_params and named_by_params <= set(asked), named_by_params - set(asked)


def test_none_is_the_models_own_numerics_bit_for_bit():
    model, ids = tiny("llama"), tiny_ids("llama")
    want = jax.jit(jax.value_and_grad(lm))(model, ids)
    got = jax.jit(jax.value_and_grad(lm_in("none")))(model, ids)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("spec", ["fp8_all", "mxfp8", "blockwise"])
def test_each_recipe_changes_the_loss_by_its_quantization_error_only(spec):
    """FP8 is not float32 (the loss moves) but a small rounding of it (by well under 1%)."""
    model, ids = tiny("llama"), tiny_ids("llama")
    base = float(jax.jit(lm)(model, ids))
    first = float(jax.jit(lm_in(spec))(model, ids))
    assert first != base and abs(first - base) < 5e-3 * abs(base), (first, base)


def test_deepseek_preset_is_the_reports_blockwise_recipe_on_every_projection():
    P = precision_map_for(tiny("deepseek_v3"))
    assert dict(P.preset("deepseek").items()) == dict.fromkeys(P.names(), "blockwise")
    mixed = P.parse("deepseek+kv_b=tensorwise,attn_out=none")
    assert (mixed.kv_b, mixed.attn_out, mixed.query) == ("tensorwise", "none", "blockwise")


def test_bad_maps_name_the_culprit():
    llama, qwen = tiny("llama"), tiny("qwen3")
    with pytest.raises(PrecisionError, match=r"no matmul named 'quer' \(did you mean 'query'\?\)"):
        resolve("fp8_all+quer=mxfp8", llama)
    with pytest.raises(PrecisionError, match=r"unknown recipe 'fp4'.*tensorwise"):
        resolve("query=fp4", llama)
    with pytest.raises(PrecisionError, match=r"no preset 'fp8_al' \(did you mean 'fp8_all'\?\)"):
        resolve("fp8_al", llama)
    with pytest.raises(PrecisionError, match="must be a Qwen3Precision"):
        resolve(precision_map_for(llama).preset("fp8_all"), qwen)
    with pytest.raises(ConfigError, match=r"^--precision deepseek: .*no preset 'deepseek'"):
        check_model(llama, seq_len=8, placement=None, precision="deepseek")
    with pytest.raises(PrecisionError, match="no matmul named 'mlp_gat'"):
        make_train_step(llama, TrainConfig(precision="mlp_gat=tensorwise"), optax.sgd(0.1))
    # Routed experts in FP8 run on the capacity kernel only: another expert path is refused by name.
    grouped = tiny("deepseek_v3").with_expert_impl("grouped")
    with pytest.raises(ConfigError, match=r"moe_gate=tensorwise.*'capacity' expert path only, not on 'grouped'"):
        jax.eval_shape(lm_in("fp8_all"), grouped, tiny_ids("deepseek_v3"))
    jax.eval_shape(lm_in("fp8_all+moe_gate=none,moe_up=none,moe_down=none"), grouped, tiny_ids("deepseek_v3"))


def test_an_fp8_train_step_lowers_the_loss_as_the_float32_step_does():
    """Tensorwise FP8 on every projection, three AdamW steps on one batch: the loss falls as in
    float32. (On this width-64 model one FP8 GEMM is off by a few percent, so the logits by ~10%
    and the steps' drops by a few percent; the 300-step figures are benchmarks/fp8.py's.)"""
    model, ids = tiny("llama"), tiny_ids("llama")
    params = eqx.filter(model, eqx.is_inexact_array)

    def losses(precision):
        cfg = TrainConfig(steps=3, batch_size=ids.shape[0], seq_len=ids.shape[1], warmup=0, precision=precision)
        tx = optimizer(dataclasses.replace(cfg, lr=3e-2), model)
        step = make_train_step(model, cfg, tx)
        p = jax.tree.map(jnp.copy, params)  # the step donates them; the cached model's stay
        s, out = tx.init(p), []
        for i in range(3):
            p, s, metrics = step(p, s, ids[None], jnp.asarray(i))
            out.append(float(metrics["loss"]))
        return np.array(out)

    f32, fp8_all = losses(None), losses("fp8_all")
    assert np.all(np.diff(fp8_all) < 0), fp8_all
    assert abs(fp8_all[0] - f32[0]) < 1e-3 * f32[0]  # the same model before any update
    # not a parity check: FP8 against float32 numerics, whose gap is the quantization's (measured
    # 2.2% at the third step here); the loss falling and the step's exactness are checked above and
    # in test_fp8, the 300-step gap in benchmarks/fp8.py
    np.testing.assert_allclose(fp8_all, f32, rtol=5e-2)
    assert not np.array_equal(fp8_all, f32)


def test_the_cuda_step_has_fp8_dots_for_exactly_the_tensorwise_matmuls():
    """The training step exported for CUDA: each tensorwise matmul of the map is three FP8 x FP8
    dots (forward, input and weight gradient) in the scanned layer bodies; the matmul the map
    leaves out (``mlp_down``), attention and the head stay float32 dots."""
    model, ids = tiny("llama"), tiny_ids("llama")
    cfg = TrainConfig(batch_size=ids.shape[0], seq_len=ids.shape[1], precision="fp8_all+mlp_down=none")
    tx = optimizer(cfg, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    step = make_train_step(model, cfg, tx)
    mlir = jax.export.export(step, platforms=["cuda"])(params, tx.init(params), ids[None], jnp.int32(0)).mlir_module()
    dots = [line.rsplit(":", 1)[1] for line in mlir.splitlines() if "stablehlo.dot_general" in line]
    fp8_dots = [d for d in dots if "f8E4M3FN" in d or "f8E5M2" in d]
    assert len(fp8_dots) == 3 * 6, fp8_dots  # query, key, value, attn_out, mlp_gate, mlp_up
    # mlp_down's three products: [T F] @ [F D] and its gradients, float32, with F = intermediate_size
    f = model.config.intermediate_size
    down = [d for d in dots if d not in fp8_dots and f"x{f}xf32" in d and "f8" not in d]
    assert len(down) == 3, down


def test_the_cuda_step_has_block_scaled_fp8_dots_for_exactly_the_mxfp8_matmuls():
    """Issue 40: exported for CUDA, each MXFP8 matmul of the map is three of XLA's block-scaled FP8
    dots (``jax.nn.scaled_matmul``'s ``__op$block_scaled_dot``: E4M3 codes, E8M0 scales, float32
    out; cuDNN's block-scaled GEMM on a GPU that has one), forward, input and weight gradient; the
    matmul the map leaves out (``mlp_down``) has none. On CPU the same products run on the
    dequantized operands (``tests/test_fp8.py``'s NumPy references)."""
    model = tiny("llama")
    ids = jnp.zeros((2, 32), jnp.int32)  # 64 tokens: the weight gradients' blocks of 32 along them
    cfg = TrainConfig(batch_size=ids.shape[0], seq_len=ids.shape[1], precision="mxfp8+mlp_down=none")
    tx = optimizer(cfg, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    step = make_train_step(model, cfg, tx)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")]
    mlir = jax.export.export(step, platforms=["cuda"], disabled_checks=checks)(
        params, tx.init(params), ids[None], jnp.int32(0)).mlir_module()  # fmt: skip
    calls = _reached(mlir, "@__op$block_scaled_dot")
    assert len(calls) == 3 * 6, calls  # query, key, value, attn_out, mlp_gate, mlp_up
    assert all(c.count("f8E4M3FN>") == 2 and c.count("f8E8M0FNU>") == 2 for c in calls), calls


def _reached(mlir: str, needle: str) -> list[str]:
    """The lines holding ``needle`` as often as the module's ``main`` reaches them: once a call
    site (the lowering makes one private function of identical branches and calls it again)."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in mlir.splitlines():
        if m := re.match(r"\s*func\.func \w+ @([\w.$-]+)\(", line):
            name = m.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)

    def reach(func: str) -> list[str]:
        out = []
        for line in bodies.get(func, []):
            if needle in line:
                out.append(line.rsplit(":", 1)[1])
            out += [hit for callee in re.findall(r"call @([\w.$-]+)\(", line) for hit in reach(callee)]
        return out

    return reach("main")


# -- FP8 residuals: the map keeps or moves the FP8 copy a matmul's backward pass reads -------------

SMALL = dataclasses.replace(llama_preset("tiny"), hidden_size=128, intermediate_size=512, num_layers=4)


def _step(precision, placement):
    """A bf16 Llama's loss and gradient with ``precision`` and ``placement``, jitted on its arrays."""
    model = zoo.Llama(SMALL, key=jax.random.key(0), compute_dtype=jnp.bfloat16)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def f(p, ids):
        m = eqx.combine(p, static)
        with using(precision, m):
            return zoo.lm_loss(m, ids, placement=placement)

    return jax.jit(jax.value_and_grad(f)), params


def _saved(precision, placement, ids) -> list[str]:
    """What the backward pass keeps, as ``dtype[shape]`` (``print_saved_residuals``)."""
    model = zoo.Llama(SMALL, key=jax.random.key(0), compute_dtype=jnp.bfloat16)

    def f(m):
        with using(precision, m):
            return zoo.lm_loss(m, ids, placement=placement)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, model)
    return [line.split(" ", 1)[0] for line in out.getvalue().splitlines()]


def _kept_by_map(precision, name, ids):
    """What keeping ``name`` on device adds to the saved residuals under ``precision`` (sorted
    ``dtype[shape]``), and what it adds to XLA:CPU's compiled temporaries."""
    sizes, saved = [], []
    for placement in (f"remat+{name}=device", "remat"):
        step, params = _step(precision, placement)
        sizes.append(step.lower(params, ids).compile().memory_analysis().temp_size_in_bytes)
        saved.append(collections.Counter(_saved(precision, placement, ids)))
    return sorted((saved[0] - saved[1]).elements()), sizes[0] - sizes[1]


def test_a_kept_fp8_gemm_input_costs_half_its_bfloat16_bytes():
    """Keeping ``mlp_hidden`` (the down projection's input) on device keeps, with ``mlp_down`` in
    FP8, its FP8 copy (one byte per element, as its bits) and its scale instead of the bf16 tensor
    (the numbers the backward pass reads are the FP8 copy's either way); XLA:CPU's compiled
    temporaries for the kept tensor fall by at least that byte per element."""
    ids = jnp.zeros((1, 256), jnp.int32)
    stacked = f"[{SMALL.num_layers},{ids.size},{SMALL.intermediate_size}]"  # [L, T, F]
    elements = SMALL.num_layers * ids.size * SMALL.intermediate_size

    (bf16_saved, bf16), (fp8_saved, fp8_kept) = (_kept_by_map(p, "mlp_hidden", ids) for p in (None, "mlp_down=tensorwise"))
    assert bf16_saved == [f"bf16[{SMALL.num_layers},1,{ids.size},{SMALL.intermediate_size}]"], bf16_saved  # [L B S F]
    assert fp8_saved == [f"f32[{SMALL.num_layers},1,1]", "u8" + stacked], fp8_saved  # the copy and its scale
    assert bf16 - fp8_kept >= 0.99 * elements, (bf16, fp8_kept, elements)


def test_a_kept_moe_hidden_is_its_fp8_codes_under_a_tensorwise_down_projection():
    """Issue 40, the routed experts' FP8 residual: the capacity kernel's SwiGLU output
    (``moe_hidden``, the down projection's input, kept a row per pair) is kept as its FP8 codes
    where ``moe_down`` is tensorwise, the codes being all the backward pass reads of it: keeping
    it on device saves a byte per element where it saved the bf16 rows, and XLA:CPU's compiled
    temporaries for it fall. (Measured, 32,768 elements: keeping the bf16 rows costs 9.3 bytes
    an element under jax 0.10.2's XLA:CPU and 3.2 under 0.12.1's, the codes 2.4 and 2.3: XLA:CPU
    has no FP8 dot and upcasts them. Bound: three quarters of the byte saved.)"""
    from zoo.qwen3 import preset as qwen3_preset

    model = zoo.Qwen3(qwen3_preset("tiny", "qwen3_moe"), key=jax.random.key(0), compute_dtype=jnp.bfloat16)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    ids = jnp.zeros((1, 256), jnp.int32)

    def kept(precision):
        sizes, saved = [], []
        for placement in ("remat+moe_hidden=device", "remat"):
            def f(p, ids, placement=placement):
                m = eqx.combine(p, static)
                with using(precision, m):
                    return m.loss(ids, placement=placement)[0]

            step = jax.jit(jax.value_and_grad(f))
            sizes.append(step.lower(params, ids).compile().memory_analysis().temp_size_in_bytes)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                jax.ad_checkpoint.print_saved_residuals(f, params, ids)
            saved.append(collections.Counter(line.split(" ", 1)[0] for line in out.getvalue().splitlines()))
        return sorted((saved[0] - saved[1]).elements()), sizes[0] - sizes[1]

    (bf16_saved, bf16), (fp8_saved, fp8_kept) = kept(None), kept("moe_down=tensorwise")
    assert len(bf16_saved) == 1 and bf16_saved[0].startswith("bf16["), bf16_saved
    rows = bf16_saved[0][len("bf16"):]  # [L, P, M]: the MoE layers' rows, one per pair
    assert fp8_saved == ["u8" + rows], fp8_saved
    elements = math.prod(int(n) for n in rows.strip("[]").split(","))
    assert bf16 - fp8_kept >= 0.75 * elements, (bf16, fp8_kept, elements)


def test_the_planner_traces_the_fp8_step_and_counts_its_fp8_residuals():
    """The planner traces the step with its precision map (before 2026-12-07 without it: the
    bf16 step's memory), and a name carried by an FP8 copy and its scale counts their bytes, not
    the wide tensor it replaces (it counted the last array's shape, the scale, once per array:
    48 bytes for ``mlp_hidden``). Its estimate is within 10% of XLA:CPU's compiled step."""
    from zoo import plan

    model = zoo.Llama(SMALL, key=jax.random.key(0))  # float32 (XLA:CPU holds no upcast copies)
    kw = {"batch_size": 2, "seq_len": 256, "placement": "remat+mlp_hidden=device"}
    wide = plan.estimate(model, **kw).residuals["mlp_hidden"][0]
    assert wide == SMALL.num_layers * 512 * SMALL.intermediate_size * 4
    got = plan.measure(model, precision="mlp_down=tensorwise", **kw)
    assert got.predicted.residuals["mlp_hidden"][0] == wide // 4 + SMALL.num_layers * 4  # a byte an element, a scale a layer
    assert abs(got.predicted.device_bytes / got.device_bytes - 1) <= 0.10, (got.predicted.device_bytes, got.device_bytes)


def test_an_input_of_several_fp8_gemms_is_kept_as_one_fp8_copy():
    """``attn_norm`` feeds the query, key and value projections and nothing else in the backward
    pass: with all three in FP8 they share one FP8 copy of it (quantized once), which a map keeping
    ``attn_norm`` keeps (a byte per element and a scale) instead of the bf16 tensor; XLA:CPU's
    temporaries for it fall by at least that byte per element. With one of the three in bf16 the
    bf16 tensor is needed, and kept, as before."""
    ids = jnp.zeros((1, 256), jnp.int32)
    elements = SMALL.num_layers * ids.size * SMALL.hidden_size
    qkv = "query=tensorwise,key=tensorwise,value=tensorwise"
    (bf16_saved, bf16), (fp8_saved, fp8_kept) = (_kept_by_map(p, "attn_norm", ids) for p in (None, qkv))
    assert bf16_saved == [f"bf16[{SMALL.num_layers},1,{ids.size},{SMALL.hidden_size}]"], bf16_saved
    assert fp8_saved == [f"f32[{SMALL.num_layers},1,1]", f"u8[{SMALL.num_layers},{ids.size},{SMALL.hidden_size}]"], fp8_saved
    assert bf16 - fp8_kept >= 0.99 * elements, (bf16, fp8_kept, elements)
    mixed_saved, _ = _kept_by_map("query=tensorwise,key=tensorwise", "attn_norm", ids)  # value reads bf16
    assert f"bf16[{SMALL.num_layers},1,{ids.size},{SMALL.hidden_size}]" in mixed_saved, mixed_saved


def test_an_offloaded_fp8_gemm_input_moves_its_fp8_bytes():
    """Exported for CUDA with ``mlp_hidden`` in pinned host memory: the layer loops move the FP8
    copy (and its float32 scale) to host and back, never the bf16 tensor."""
    step, params = _step("mlp_down=tensorwise", "remat+mlp_hidden=pinned_host")
    mlir = jax.export.export(step, platforms=["cuda"])(params, jnp.zeros((2, 128), jnp.int32)).mlir_module()
    loops, _ = placement_annotations(mlir)
    moved = collections.Counter(t for c in loops for (_, t), k in c.items() for _ in range(k))
    rows = f"tensor<256x{SMALL.intermediate_size}x"
    assert moved[rows + "ui8>"] == 2 and not any(t.startswith(rows) and "bf16" in t for t in moved), moved


def test_an_fp8_step_runs_on_a_mesh_close_to_one_device():
    """The FP8 step under ``shard_map`` (data, FSDP and tensor axes): each device quantizes what
    it holds (its rows, its gathered layer, its tensor shard) with the whole tensor's tensorwise
    scale (its largest magnitude over the devices holding its parts), so the step is one device's
    FP8 step up to float32 summation order. (jax.checkpoint rounds each
    saved residual with reduce_precision at its format's exponent and mantissa widths, for E4M3FN
    IEEE's E4M3, largest finite 240; XLA:CPU ran it in this step, and an FP8 copy kept as FP8
    came back NaN from 256 to 448: the copies are kept as their bits.)"""
    from zoo import parallel

    model, ids = tiny("llama"), tiny_ids("llama")
    ids = jnp.concatenate([ids, ids[:, ::-1]], axis=0)  # 4 rows: the data and FSDP axes split them
    cfg = TrainConfig(batch_size=ids.shape[0], seq_len=ids.shape[1], warmup=0, precision="fp8_all")
    tx = optimizer(cfg, model)

    def first_loss(mesh):
        params = jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array))
        if mesh is None:
            opt = tx.init(params)
        else:
            params = parallel.shard(params, mesh)
            opt = parallel.init_optimizer(tx, params, mesh)
        _, _, metrics = make_train_step(model, cfg, tx, mesh=mesh)(params, opt, ids[None], jnp.int32(0))
        return float(metrics["loss"]), float(metrics["grad_norm"])

    one, sharded = first_loss(None), first_loss(parallel.make_mesh("data=2,fsdp=2,tensor=2"))
    assert np.isfinite(sharded).all()
    # Measured: loss 8.4e-8 and gradient norm 9.1e-5 relative (per-shard scales, before: 8.8e-4 and
    # 4.5e-3). The norm's 1e-4: the mesh sums in another order, and a float32 value on the other
    # side of an FP8 rounding boundary moves by a unit of E4M3's 3-bit mantissa (E5M2's 2 bits
    # for cotangents), which no order-independent parity at 1e-5 survives.
    np.testing.assert_allclose(sharded[0], one[0], rtol=1e-6)
    np.testing.assert_allclose(sharded[1], one[1], rtol=5e-4)


@pytest.mark.parametrize("spec", ["fsdp=8", "data=2,expert=4"])
def test_routed_experts_in_fp8_on_a_mesh_quantize_as_one_device(spec):
    """Issue 40: the routed experts' tensorwise scales are each expert's over all its rows on every
    device (the FSDP and data axes' rows, the rows the expert group dispatches to it), so the
    FP8 step on a mesh is one device's. Measured: loss equal, gradient norm 1.8e-7 and 2.7e-7
    relative (float32 summation order). With each device's own scales per expert the fsdp=8
    norm is 6.5e-4 off; with the scales' maximum taken over the expert axis too (mixing
    different experts'), the expert-parallel one 2.1e-4. A capacity factor of 8 dispatches every pair in one round: a later round (the rare case) is
    a pass of its own, scaled over its rows (docs/precision.md)."""
    from zoo import parallel

    model = zoo.from_pretrained(FIXTURES / CASES["qwen3_moe"], capacity_factor=8.0)
    ids = tiny_ids("qwen3_moe")
    ids = jnp.concatenate([ids, ids[:, ::-1]] * 2, axis=0)[:8]
    cfg = TrainConfig(batch_size=ids.shape[0], seq_len=ids.shape[1], warmup=0, precision="fp8_all")
    tx = optimizer(cfg, model)

    def first_step(mesh):
        params = jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array))
        opt = tx.init(params) if mesh is None else parallel.init_optimizer(tx, params := parallel.shard(params, mesh), mesh)
        _, _, metrics = make_train_step(model, cfg, tx, mesh=mesh)(params, opt, ids[None], jnp.int32(0))
        return float(metrics["loss"]), float(metrics["grad_norm"])

    one, sharded = first_step(None), first_step(parallel.make_mesh(spec))
    np.testing.assert_allclose(sharded[0], one[0], rtol=1e-6)
    np.testing.assert_allclose(sharded[1], one[1], rtol=1e-5)


def test_a_placement_map_never_changes_an_fp8_steps_numbers():
    """Placement changes memory, never numerics, FP8 included: the loss and gradients of a
    tensorwise step under a map equal those without one (the FP8 copies a map saves included)."""
    model, ids = tiny("llama"), tiny_ids("llama")

    def step(placement):
        def f(m, i):
            with using("fp8_all", m):
                return zoo.lm_loss(m, i, placement=placement)

        return eqx.filter_jit(eqx.filter_value_and_grad(f))(model, ids)

    want = step(None)
    for placement in ("device", "remat", "remat+mlp_hidden=device,attn_norm=device"):
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(step(placement)), strict=True):
            assert np.isfinite(np.asarray(b)).all(), placement
            # remat recomputes the float32 work in other fusions: last-bit differences (~1 ulp; 4% of
            # elements under "remat"), the same rtol as test_placement_maps' float32 checks
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7, err_msg=placement)


@pytest.mark.parametrize("model_type, spec, precision", [
    ("llama", "data=2,fsdp=2,tensor=2", "fp8_all"), ("deepseek_v3", "fsdp=4,tensor=2", "fp8_all"),
    ("qwen3_moe", "fsdp=2,expert=4", "fp8_all"), ("llama", "fsdp=8", "blockwise"),
    ("qwen3_moe-wide", "fsdp=2,expert=4", "blockwise")])  # fmt: skip
def test_fsdp_gathers_a_tensorwise_weight_as_its_fp8_codes_with_the_same_numbers(model_type, spec, precision):
    """Issue 40: under a tensorwise map, each device quantizes its block of a layer weight with the
    whole weight's scale (a pmax of its largest magnitude) and the FSDP gather moves the FP8
    codes. The codes are those of the gathered weight, so the step is the one that gathers in the
    compute dtype: the loss and the updated parameters bit for bit (tensor-split heads and
    hidden units, and DeepSeek-V3's MLA, dense and shared MLPs included). On the expert mesh the
    peer sends the dispatch's rows in the compute dtype too (the same numbers: the rows' codes
    are those the experts' kernel takes). Blockwise (DeepSeek-V3's recipe, 2026-12-07): each
    128x128 block's scale is its largest magnitude over the devices holding its parts; on
    ``fsdp=8`` a block of the tiny Llama spans up to 8 devices' blocks of the weight; Qwen3-MoE's
    attention and router weights are gathered over ``fsdp`` and ``expert`` at once, and at a width
    of 256 each 128-row block spans 4 of the 8 devices' blocks, in the gather's order."""
    from zoo import parallel

    wide = model_type.endswith("-wide")
    model_type = model_type.removesuffix("-wide")
    model, ids = tiny(model_type), tiny_ids(model_type)
    if wide:
        model = type(model)(dataclasses.replace(model.config, hidden_size=256), key=jax.random.key(0))
    ids = jnp.concatenate([ids, ids[:, ::-1]] * 2, axis=0)[:8]
    cfg = TrainConfig(batch_size=ids.shape[0], seq_len=ids.shape[1], warmup=0, precision=precision)
    tx = optimizer(cfg, model)
    mesh = parallel.make_mesh(spec)

    def step():
        params = parallel.shard(jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array)), mesh)
        new, _, metrics = make_train_step(model, cfg, tx, mesh=mesh)(
            params, parallel.init_optimizer(tx, params, mesh), ids[None], jnp.int32(0))  # fmt: skip
        return float(metrics["loss"]), jax.tree.leaves(new)

    fp8_gathers = step()
    with fp8.fp8_gathers(False), fp8.fp8_dispatch(False):
        compute_dtype_gathers = step()
    assert fp8_gathers[0] == compute_dtype_gathers[0]
    for a, b in zip(fp8_gathers[1], compute_dtype_gathers[1], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _product_weight_bytes(config) -> int:
    """Float32 bytes of a model's layer weights that a product reads: a named one
    (:attr:`zoo.core.params.Param.matmul`) or the routed experts' kernel (their experts' letter
    laid out on the ``expert`` axis)."""
    from zoo.core.layout import is_layer_stack, model_specs, rules_of
    from zoo.core.params import map_params
    from zoo.plan._step import abstract_model

    model = abstract_model(config, None)
    specs, rules = model_specs(model), rules_of(model)

    def read_by_a_product(p) -> bool:  # a projection, or a routed expert's matrix ([L, E, in, out])
        rule = rules.get(p.names[1]) if len(p.names) > 1 else None
        return p.matmul is not None or (rule is not None and rule.mesh_axis == "expert" and len(p.names) == 4)

    sizes = []
    map_params(lambda path, x: sizes.append(x.size if is_layer_stack(specs[path]) and read_by_a_product(specs[path]) else 0), model)
    return 4 * sum(sizes)


@pytest.mark.parametrize(("family", "precision"), [("llama", "fp8_all"), ("deepseek_v3", "fp8_all"), ("llama", "blockwise")])
def test_an_fp8_gather_moves_a_byte_an_element(family, precision):
    """Issue 40: on ``fsdp=8`` under full remat and ``fp8_all`` (float32 compute): the step's
    all-gathers over ``fsdp``, counted on the traced step and in XLA's compiled program alike,
    carry each projection's weight, the routed experts' included, at a byte an element, twice a
    step (the forward pass and the backward pass's re-gather): the compute-dtype step's bytes
    less 3/4 of those weights' float32 bytes, twice. The norms, router, embedding and head are
    still gathered in float32, and the reduce-scatters of the gradients are unchanged. The same
    under the blockwise recipe (whose block scales are all-reduced, not gathered)."""
    from zoo import registry
    from zoo.plan import collectives
    from zoo.plan._step import make_step

    config = registry.by_model_type(family).config_cls.preset("tiny", family)
    if family == "deepseek_v3":  # two layers in each stack: a stack of one keeps its gathers for the backward pass
        config = dataclasses.replace(config, num_layers=4, first_k_dense_replace=2)

    def traffic():
        step = make_step(config, batch_size=8, seq_len=64, mesh="fsdp=8", placement="remat", precision=precision)
        jaxpr, compiled = step.compile()
        traced = collectives.traced(jaxpr, step.sizes)
        # (Below 2 KB, XLA:CPU's program has the scales' all-reduces in other groupings.)
        assert collectives.totals(traced, floor=2048) == collectives.hlo_traffic(compiled.as_text(), step.sizes, floor=2048)
        return collectives.totals(traced)

    fp8_gathers = traffic()
    with fp8.fp8_gathers(False):
        compute_dtype_gathers = traffic()
    gather, scatter = ("all_gather", ("fsdp",)), ("reduce_scatter", ("fsdp",))
    assert compute_dtype_gathers[gather] - fp8_gathers[gather] == 2 * _product_weight_bytes(config) * 3 // 4
    assert compute_dtype_gathers[scatter] == fp8_gathers[scatter]


def test_the_dispatchs_later_rounds_run_the_maps_recipes_in_the_backward_pass(monkeypatch):
    """The expert dispatch's later rounds (past the first round's slots: capacity factor 0.5)
    run their pair MLP again in the backward pass, traced after the model's call has left the
    precision map's context: every routed-expert product, forward and backward, runs the map's
    recipe (before the fix the later rounds' backward products ran in bfloat16: "none")."""
    from zoo import parallel
    from zoo.layers import expert_products as ep

    seen = set()
    for name in ("product", "input_grad", "weight_grad"):
        real = getattr(ep, name)
        monkeypatch.setattr(ep, name, lambda *a, _real=real, **k: seen.add(a[2]) or _real(*a, **k))
    model = zoo.from_pretrained(FIXTURES / CASES["qwen3_moe"], capacity_factor=0.5)
    ids = jax.random.randint(jax.random.key(1), (8, 16), 0, model.config.vocab_size, dtype=jnp.int32)
    mesh = parallel.make_mesh("data=2,expert=4")

    def f(m, ids):
        with using("fp8_all", m):
            return m.loss(ids)[0]

    jax.eval_shape(parallel.value_and_grad(f, mesh, frozen="none"), parallel.shard(model, mesh), ids)
    assert seen == {"tensorwise"}


@pytest.mark.parametrize("case", ["1f1b", "lora-dropout"])
def test_fp8_gathers_keep_the_numbers_on_a_1f1b_pipeline_and_under_lora_dropout(case):
    """The FP8 gather where a stage runs its layers in 1F1B's ticks (``pipeline=2,fsdp=4``): loss
    and gradients bit for bit those of the compute-dtype gathers. Under LoRA with dropout
    (``fsdp=8``; dropout's term lays its factors out by the gathered weight's shape): the loss bit
    for bit, the adapters' gradients to float32 rounding. (Measured: up to 5.6e-9 apart with the
    suite's XLA flags, -O0; bit for bit with XLA's defaults. On ``fsdp=4,tensor=2`` the same
    rounding moved E5M2 cotangent codes, 1.5e-6 on 1e-4, as any reordering of float32 sums in
    an FP8 step does: test_an_fp8_step_runs_on_a_mesh_close_to_one_device.)"""
    from test_lora_dropout import _adapted

    from zoo import lora, parallel

    model = _adapted("llama", 0.1) if case == "lora-dropout" else tiny("llama")
    spec, options = ("fsdp=8", {}) if case == "lora-dropout" else ("pipeline=2,fsdp=4", {"microbatches": 2, "schedule": "1f1b"})
    mesh = parallel.make_mesh(spec)
    ids = jax.random.randint(jax.random.key(1), (8, 16), 0, model.config.vocab_size, dtype=jnp.int32)

    def f(m, ids):
        with lora.dropout_key(jax.random.key(0)), using("fp8_all", m.base if isinstance(m, lora.LoraModel) else m):
            out = m.loss(ids)
            return out[0] if isinstance(out, tuple) else out

    def run():
        return jax.tree.leaves(parallel.value_and_grad(f, mesh, frozen="none", **options)(parallel.shard(model, mesh), ids))

    got = run()
    with fp8.fp8_gathers(False):
        want = run()
    assert float(got[0]) == float(want[0])
    for a, b in zip(got[1:], want[1:], strict=True):
        if case == "1f1b":
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
