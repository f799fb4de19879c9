"""The placement map mechanism: parsing, presets, errors, registration, the Llama map's memory
chain, and parameters / optimizer state in pinned host memory between steps.

What every family's map must satisfy (one source of truth with the model code, every name
matters, numerics never change, the CUDA program moves exactly the offloaded names) is
``test_placement_maps.py``, run on every registered family."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import re
from dataclasses import dataclass
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import FIXTURES, reference
from helpers import run_in_fresh_process, supported_compile_options
from hypothesis import strategies as st

import zoo
from zoo import LlamaPlacement, PlacementError, parallel
from zoo import train as ztrain
from zoo.llama import preset
from zoo.placement import (
    PlacementMap,
    layer_policy,
    memory_kinds,
    placement_map_for,
    tree_placement,
)

NAMES = LlamaPlacement.names()
PRESETS = LlamaPlacement.preset_names()
# XLA:CPU compiles ~5x faster without LLVM optimisation and the MLIR fusion emitters; the
# buffers are the same to within a few hundred bytes, the arithmetic is the same float32.
FAST = supported_compile_options({"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False})


@functools.cache
def tiny() -> zoo.Llama:
    return zoo.from_pretrained(FIXTURES / "llama3_1-tiny")


@functools.cache
def tiny_ids() -> jax.Array:
    return jnp.asarray(reference("llama3_1-tiny")["input_ids"])


def maps() -> st.SearchStrategy[LlamaPlacement]:
    """Random maps: every field any placement it accepts."""
    return st.builds(LlamaPlacement, **{n: st.sampled_from(LlamaPlacement.choices(n)) for n in NAMES})


# -- one source of truth -------------------------------------------------------------------


# -- every name matters ----------------------------------------------------------------------


def residuals(model, ids, placement) -> collections.Counter:
    """What the backward pass keeps, as ``dtype<memory>[shape]`` strings (``<host>`` marks
    pinned host memory), from ``jax.ad_checkpoint.print_saved_residuals``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda m: zoo.lm_loss(m, ids, placement=placement), model)
    return collections.Counter(line.split(" ", 1)[0] for line in out.getvalue().splitlines())


def test_a_tensor_the_backward_never_needs_would_be_a_dead_name(monkeypatch):
    """Why the down projection has no name: it only feeds the add that ends the layer, so
    saving or recomputing it leaves the backward pass unchanged."""
    model, ids = tiny(), tiny_ids()
    real = zoo.llama.model.swiglu
    named = lambda *a, **k: jax.ad_checkpoint.checkpoint_name(real(*a, **k), "mlp_out")
    monkeypatch.setattr(zoo.llama.model, "swiglu", named)
    monkeypatch.setattr(zoo.llama.model, "layer_policy", lambda policy, model: policy)
    save = jax.checkpoint_policies.save_only_these_names(*NAMES, "mlp_out")
    skip = jax.checkpoint_policies.save_only_these_names(*NAMES)
    assert residuals(model, ids, save) == residuals(model, ids, skip)
    # ... whereas the attention output projection, which also only feeds an add, matters
    # (the add's result feeds the MLP norm): test_placement_maps.py's every-name test covers attn_out.


# -- numerics never change ---------------------------------------------------------------


# -- the CUDA program moves exactly the offloaded names -------------------------------------

_FUNC = re.compile(r"^(\s*)func\.func (?:public|private) @([\w.$-]+)\(")
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call @([\w.$-]+)\(")  # not custom_call
_ANNOTATE = re.compile(
    r'@annotate_device_placement\(.*_xla_buffer_placement = "(\w+)".*: \((tensor<[^>]*>)\) ->'
)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _close(lines: list[str], start: int) -> int:
    """The line closing the region opened at ``start`` (the next ``}`` at its indentation)."""
    ind = _indent(lines[start])
    return next(
        i for i in range(start + 1, len(lines)) if _indent(lines[i]) == ind and lines[i].lstrip().startswith("}")
    )


def placement_annotations(mlir: str) -> tuple[list[collections.Counter], collections.Counter]:
    """``annotate_device_placement`` custom calls of a StableHLO module, as
    ``(placement, tensor type)`` counts: per ``while`` loop body (a scan) and for the whole
    program run from ``main``, through the function calls, once per call."""
    lines = mlir.splitlines()
    funcs = {m.group(2): (i, _close(lines, i)) for i, line in enumerate(lines) if (m := _FUNC.match(line))}

    @functools.cache
    def in_func(name: str) -> collections.Counter:
        return in_span(*funcs[name])

    def in_span(a: int, b: int) -> collections.Counter:
        found: collections.Counter = collections.Counter()
        for line in lines[a + 1 : b]:
            if m := _ANNOTATE.search(line):
                found[m.groups()] += 1
            for callee in _CALL.findall(line):
                found += in_func(callee)
        return found

    loops = [in_span(i, _close(lines, i)) for i, line in enumerate(lines) if line.strip() == "} do {"]
    return loops, in_func("main")


def tensor_type(s: jax.ShapeDtypeStruct) -> str:
    return f"tensor<{'x'.join(map(str, s.shape))}x{ {jnp.dtype(jnp.float32): 'f32'}[jnp.dtype(s.dtype)] }>"


# -- memory moves the right way --------------------------------------------------------------


def test_device_memory_falls_as_names_move_to_remat():
    """Compiled temp bytes of the training step on a deeper, longer model: each name moved
    from device to remat lowers them, and full remat is far below everything on device."""
    config = dataclasses.replace(
        preset("tiny"), hidden_size=128, intermediate_size=512, num_layers=16, num_heads=4, num_kv_heads=2, head_dim=32
    )
    model = jax.eval_shape(lambda: zoo.Llama(config, key=jr.key(0)))
    ids = jax.ShapeDtypeStruct((4, 64), jnp.int32)

    def temp(placement) -> int:
        step = jax.jit(lambda m, ids: eqx.filter_value_and_grad(zoo.lm_loss)(m, ids, placement=placement))
        return step.lower(model, ids).compile(FAST).memory_analysis().temp_size_in_bytes

    chain = {"device": LlamaPlacement.preset("device")}
    for name in NAMES:
        if "remat" in LlamaPlacement.choices(name):
            chain[name] = dataclasses.replace(list(chain.values())[-1], **{name: "remat"})
    assert list(chain.values())[-1] == LlamaPlacement.preset("remat")
    sizes = {name: temp(placement) for name, placement in chain.items()}
    values = list(sizes.values())
    assert all(a > b for a, b in zip(values, values[1:])), sizes
    assert values[-1] * 3 < values[0], sizes


# -- parsing, presets, errors ----------------------------------------------------------------


def test_parse_forms():
    assert LlamaPlacement.parse("query=pinned_host,mlp_up=remat") == LlamaPlacement(query="pinned_host", mlp_up="remat")
    assert LlamaPlacement.parse("remat") == LlamaPlacement.preset("remat")
    remat_q = LlamaPlacement.parse(" remat + query = pinned_host ")
    assert remat_q == dataclasses.replace(LlamaPlacement.preset("remat"), query="pinned_host")
    assert LlamaPlacement.parse("remat+query=device+key=device") == dataclasses.replace(
        LlamaPlacement.preset("remat"), query="device", key="device"
    )
    for name in PRESETS:
        m = LlamaPlacement.preset(name)
        assert LlamaPlacement.parse(m.spec()) == m == LlamaPlacement.parse(name)


def test_presets():
    assert set(LlamaPlacement.preset("device").placed("device")) == set(NAMES)
    remat = LlamaPlacement.preset("remat")
    assert remat.placed("device") == ("layer_input",) and len(remat.placed("remat")) == len(NAMES) - 1
    save = LlamaPlacement.preset("save_matmuls")
    matmuls = ("query", "key", "value", "context", "attn_lse", "attn_out", "mlp_gate", "mlp_up")
    assert save.placed("device") == ("layer_input", *matmuls)
    offload = LlamaPlacement.preset("offload_attn")
    assert offload.placed("pinned_host") == ("layer_input", "query", "key", "value")
    assert offload.placed("remat") == save.placed("remat")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("quer=pinned_host", r"no tensor named 'quer' \(did you mean 'query'\?\); valid names: layer_input, attn_norm"),
        ("query=pinned", r"unknown placement 'pinned' \(did you mean 'pinned_host'\?\); valid placements: device"),
        ("save_matmul", r"no preset 'save_matmul' \(did you mean 'save_matmuls'\?\); valid presets: device, remat"),
        ("query=device+remat", "a preset name may only come first"),
        ("remat+query", "expected name=placement"),
        ("query=device,query=remat", "'query' is given twice"),
        ("  ", "empty placement spec"),
        ("remat+layer_input=remat", "layer_input cannot be 'remat'"),
    ],
)
def test_parse_errors_name_the_culprit(spec, message):
    with pytest.raises(PlacementError, match=message):
        LlamaPlacement.parse(spec)
    assert issubclass(PlacementError, ValueError)


def test_constructor_validates():
    with pytest.raises(PlacementError, match=r"LlamaPlacement.query: unknown placement 'hbm'"):
        LlamaPlacement(query="hbm")  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="LlamaPlacement.key: unknown placement"):
        dataclasses.replace(LlamaPlacement(), key="host")


# -- the map fits the model ------------------------------------------------------------------


class ToyModel:
    """Stands in for a second model (DeepSeek-V3 registers the same way)."""


@dataclass(frozen=True)
class ToyPlacement(PlacementMap, model=ToyModel):
    presets: ClassVar[dict[str, str]] = {"keep_router": "remat+router=device"}
    router: zoo.Placement = "device"
    expert_out: zoo.Placement = "device"


def test_a_second_model_registers_its_map_by_declaring_it():
    assert placement_map_for(ToyModel()) is ToyPlacement
    assert placement_map_for(zoo.Llama) is LlamaPlacement
    assert ToyPlacement.preset("keep_router") == ToyPlacement(router="device", expert_out="remat")
    assert ToyPlacement.preset_names() == ("device", "remat", "keep_router")
    expected = ToyPlacement(router="pinned_host", expert_out="remat").policy()
    assert layer_policy("remat+router=pinned_host", ToyModel()) is expected


def test_presets_may_build_on_each_other_but_not_in_a_cycle():
    @dataclass(frozen=True)
    class Cyclic(PlacementMap):
        presets: ClassVar[dict[str, str]] = {"a": "b+x=remat", "b": "a", "c": "a+x=device"}
        x: zoo.Placement = "device"

    with pytest.raises(PlacementError, match="cycle: a -> b -> a"):
        Cyclic.preset("a")
    with pytest.raises(PlacementError, match="cycle: c -> a -> b -> a"):
        Cyclic.parse("c")
    assert LlamaPlacement.preset("offload_attn").attn_norm == "remat"  # built on save_matmuls, built on remat


def test_layer_policy_checks_the_map_fits_the_model():
    model = tiny()
    assert layer_policy(None, model) is None
    assert layer_policy("offload_attn", model) is LlamaPlacement.preset("offload_attn").policy()
    foreign = "a ToyPlacement places the tensors of ToyModel, not of a Llama; use LlamaPlacement"
    with pytest.raises(PlacementError, match=foreign):
        layer_policy(ToyPlacement(), model)
    with pytest.raises(PlacementError, match="ToyPlacement has no tensor named 'query'"):
        layer_policy("query=remat", ToyModel())
    with pytest.raises(TypeError, match="placement"):  # the annotation's check, or layer_policy's own
        layer_policy({"query": "remat"}, model)
    with pytest.raises(PlacementError, match="no placement map is registered for object"):
        layer_policy("remat", object())
    with pytest.raises(PlacementError, match="ToyPlacement"):
        zoo.lm_loss(model, tiny_ids(), placement=ToyPlacement())


@pytest.mark.host_memory
def test_placement_strings_reach_the_model():
    loss = zoo.lm_loss(tiny(), tiny_ids(), placement="save_matmuls+query=pinned_host")
    np.testing.assert_allclose(float(loss), float(reference("llama3_1-tiny")["loss"]), rtol=1e-5)


# -- parameters and optimizer state ----------------------------------------------------------


SHARDED_TO_HOST = """
import jax, jax.numpy as jnp
from zoo.placement import tree_placement
mesh = jax.make_mesh((8,), ("data",))
sharded = jax.device_put(jnp.arange(16.0), jax.sharding.NamedSharding(mesh, jax.P("data")))
moved = tree_placement(sharded, "pinned_host")
assert moved.sharding == sharded.sharding.with_memory_kind("pinned_host"), moved.sharding
print("ok")
"""


@pytest.mark.host_memory
def test_tree_placement_moves_whole_trees():
    model = tiny()
    on_host = tree_placement(model, "pinned_host")
    assert memory_kinds(on_host) == {"pinned_host"} and memory_kinds(model) == {"device"}
    back = tree_placement(on_host, "device")
    assert memory_kinds(back) == {"device"}
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model)))
    # Sharded: the sharding is kept (in a fresh process: helpers.run_in_fresh_process).
    assert run_in_fresh_process(SHARDED_TO_HOST).strip().endswith("ok")
    with pytest.raises(PlacementError, match="parameters cannot be 'remat': it is an input of the training step"):
        tree_placement(model, "remat", what="parameters")
    with pytest.raises((PlacementError, TypeError), match="'host'"):  # the Literal's check, or ours
        tree_placement(model, "host")  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="optimizer state cannot be 'remat'"):
        ztrain.make_train_step(model, CFG, ztrain.optimizer(CFG, model), opt_memory="remat")


# The training loop's own step (zoo.train), on the fixture's batch.
CFG = ztrain.TrainConfig(steps=10, batch_size=2, seq_len=16, warmup=1, lr=1e-2)


def _steps(params: str, opt_state: str, n: int = 3, mesh=None, model=None):
    """``n`` steps of zoo.train's step with parameters and optimizer state kept in
    ``params`` / ``opt_state`` memory between steps (sharded over ``mesh`` when given) for
    ``model`` (default: the tiny Llama fixture)."""
    model = tiny() if model is None else model
    optimizer = ztrain.optimizer(CFG, model)
    weights = jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array))  # the step donates them
    state = optimizer.init(weights)
    if mesh is not None:
        weights = parallel.shard(weights, mesh)
        state = parallel.replicate_unplaced(optimizer.init(weights), mesh)
    weights, state = tree_placement(weights, params), tree_placement(state, opt_state)
    step = ztrain.make_train_step(model, CFG, optimizer, mesh=mesh, param_memory=params, opt_memory=opt_state)
    ids = tiny_ids() if mesh is None else jnp.tile(tiny_ids(), (4, 1))  # rows for every fsdp shard
    losses = []
    for i in range(n):  # the first step's learning rate is 0 (warm-up)
        weights, state, metrics = step(weights, state, ids[None], jnp.int32(i))
        losses.append(float(metrics["loss"]))
    return weights, state, losses


@pytest.mark.host_memory
def test_train_step_with_params_and_optimizer_state_on_host_matches_device():
    ref_model, ref_state, ref_losses = _steps("device", "device")
    for params, opt_state in [("pinned_host", "pinned_host"), ("device", "pinned_host")]:
        model, state, losses = _steps(params, opt_state)
        assert memory_kinds(model) == {params} and memory_kinds(state) == {opt_state}
        assert losses == ref_losses and losses[-1] < losses[0]
        for a, b in zip(jax.tree.leaves((model, state)), jax.tree.leaves((ref_model, ref_state))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert memory_kinds((ref_model, ref_state)) == {"device"}


HOST_UNDER_A_MESH = """
import jax.numpy as jnp, numpy as np
import test_placement as t
import zoo
from zoo import parallel
from zoo.deepseek_v3 import preset
from zoo.placement import memory_kinds
deepseek = zoo.DeepseekV3(preset("tiny"), key=jax.random.key(0))
for model, spec, want in [(None, "pipeline=2,fsdp=2,tensor=2", ("pipeline", "fsdp", "tensor", None)),
                          (deepseek, "fsdp=2,expert=4", (None, "expert", "fsdp", None))]:
    mesh = parallel.make_mesh(spec)
    ref_weights, ref_state, ref_losses = t._steps("device", "device", mesh=mesh, model=model)
    weights, state, losses = t._steps("pinned_host", "pinned_host", mesh=mesh, model=model)
    assert memory_kinds(weights) == {"pinned_host"} and memory_kinds(state) == {"pinned_host"}
    assert losses == ref_losses and losses[-1] < losses[0], (spec, losses, ref_losses)
    for a, b in zip(jax.tree.leaves((weights, state)), jax.tree.leaves((ref_weights, ref_state))):
        assert a.sharding.is_equivalent_to(b.sharding.with_memory_kind("pinned_host"), a.ndim), (a.sharding, b.sharding)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    w = weights.layers.attn.wq if model is None else weights.moe_layers.moe.w_gate
    assert w.sharding.is_equivalent_to(jax.NamedSharding(mesh, jax.P(*want), memory_kind="pinned_host"), 4), w.sharding
    print(spec, losses)
print("ok")
"""


def test_params_and_optimizer_state_on_host_under_a_mesh():
    """Sharded (Llama in pipeline stages over fsdp x tensor, DeepSeek-V3 over fsdp x expert)
    and kept in pinned host memory between steps: the shardings survive the round trip and the steps equal the
    all-device sharded steps.

    In a fresh process: after any single-device pinned-host program has run in a process,
    jaxlib 0.10's XLA:CPU crashes or deadlocks in the first collective of a multi-device one
    with host-memory arguments (and so does one loaded from the persistent compilation cache).
    A training run is one process with one step, so this is how users meet it; measured.
    """
    assert run_in_fresh_process(HOST_UNDER_A_MESH).strip().endswith("ok")


def test_cuda_train_step_streams_params_and_optimizer_state():
    """Exported for CUDA: host-resident arguments and results, one copy in to device and one
    back to pinned host per parameter and optimizer-state array; none for the device step."""
    model = tiny()
    optimizer = ztrain.optimizer(CFG, model)
    weights = eqx.filter(model, eqx.is_inexact_array)
    state = optimizer.init(weights)
    leaves = len(jax.tree.leaves((weights, state)))
    for where in ("pinned_host", "device"):
        step = ztrain.make_train_step(model, CFG, optimizer, param_memory=where, opt_memory=where)
        args = (tree_placement(weights, where), tree_placement(state, where), tiny_ids()[None], jnp.int32(0))
        mlir = jax.export.export(step, platforms=["cuda"])(*args).mlir_module()
        main = next(line for line in mlir.splitlines() if "func.func public @main" in line)
        assert main.count('mhlo.memory_kind = "pinned_host"') == (2 * leaves if where == "pinned_host" else 0)
        loops, total = placement_annotations(mlir)
        assert all(not c for c in loops)  # the transfers are outside the layer scans
        moves = collections.Counter(p for (p, _), k in total.items() for _ in range(k))
        assert moves == (collections.Counter(device=leaves, pinned_host=leaves) if where == "pinned_host" else {})
