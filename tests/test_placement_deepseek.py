"""What only DeepSeek-V3's placement map has: the dense and MoE layer bodies, every expert path,
the MTP block (outside the scans, under the same policy), its presets, and the memory chain.

What every family's map satisfies is ``test_placement_maps.py``; the map mechanism itself is
``test_placement.py``'s."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import FIXTURES, reference
from helpers import global_norm
from hypothesis import strategies as st
from test_placement import FAST, placement_annotations, tensor_type
from test_placement_maps import Body, layer_bodies, residual_of

import zoo
from zoo import DeepseekV3Placement, PlacementError
from zoo.deepseek_v3 import deepseek_v3_loss, preset
from zoo.placement import layer_policy, placement_map_for

# Its numerics tests run offloading maps in this process (conftest.py orders these last).
pytestmark = pytest.mark.host_memory

P = DeepseekV3Placement
NAMES = P.names()
PRESETS = P.preset_names()
# Where each name lives: both layer kinds, the dense layers' SwiGLU only, the MoE layers only.
DENSE_ONLY = ("mlp_gate", "mlp_up", "mlp_hidden")
MOE_ONLY = ("router_logits", "moe_gate", "moe_up", "moe_hidden", "moe_out", "shared_gate", "shared_up", "shared_hidden")
BOTH = tuple(n for n in NAMES if n not in DENSE_ONLY + MOE_ONLY)


@functools.cache
def tiny(impl: str = "grouped") -> zoo.DeepseekV3:
    return zoo.from_pretrained(FIXTURES / "deepseek_v3-tiny").with_expert_impl(impl)


@functools.cache
def model_of(kind: str) -> zoo.DeepseekV3:
    """``grouped``, ``tiled``, ``ragged_dot``, ``dense``: the fixture with that expert path; ``mtp``: a
    fresh tiny model with its MTP block."""
    return tiny_mtp() if kind == "mtp" else tiny(kind)


@functools.cache
def tiny_ids() -> jax.Array:
    return jnp.asarray(reference("deepseek_v3-tiny")["input_ids"])


@functools.cache
def tiny_mtp() -> zoo.DeepseekV3:
    return zoo.DeepseekV3(preset("tiny", mtp=True), key=jr.key(0), expert_impl="grouped")


def lm(m, ids, placement):
    return zoo.lm_loss(m, ids, placement=placement)


def with_mtp(m, ids, placement):
    return deepseek_v3_loss(m, ids, placement=placement, mtp_weight=0.3)[0]


def loss_of(kind: str):
    return with_mtp if kind == "mtp" else lm


def maps() -> st.SearchStrategy[DeepseekV3Placement]:
    """Random maps: every field any placement it accepts."""
    return st.builds(P, **{n: st.sampled_from(P.choices(n)) for n in NAMES})


# -- where the names are ------------------------------------------------------------------


@functools.cache
def bodies_of(kind: str, placement="device") -> list[Body]:
    return layer_bodies(loss_of(kind), model_of(kind), tiny_ids(), placement)


@pytest.mark.parametrize("placement", [None, "device", "remat", "nvidia_offload"])
def test_fields_are_exactly_the_names_in_each_layer_body(placement):
    """Every field names a tensor of the traced program (no dead field), every
    checkpoint_name is a field, once per body: the dense scan has the attention names and the
    dense SwiGLU's, the MoE scan the attention names and the router's and experts'."""
    dense, moe = bodies_of("grouped", placement)
    assert (dense.length, moe.length) == (1, 2)
    assert dense.names == collections.Counter(BOTH + DENSE_ONLY)
    assert moe.names == collections.Counter(BOTH + MOE_ONLY)
    assert set(dense.names) | set(moe.names) == set(NAMES)
    assert dense.checkpointed == moe.checkpointed == (placement is not None)


@pytest.mark.parametrize("impl", ["ragged_dot", "dense"])
def test_every_expert_path_carries_the_same_names(impl):
    """``ragged_dot`` has every name; the ``dense`` reference path has no per-expert output
    (it folds the combine weights in before its down projection), so no ``moe_out``."""
    dense, moe = bodies_of(impl, "remat")
    assert dense.names == collections.Counter(BOTH + DENSE_ONLY)
    missing = ("moe_out",) if impl == "dense" else ()
    assert moe.names == collections.Counter(n for n in BOTH + MOE_ONLY if n not in missing)


def test_the_mtp_block_is_placed_like_a_layer():
    """The MTP block (an MoE layer outside the scans) carries the MoE layer's names and, as
    soon as a map is given, runs under the same jax.checkpoint policy."""
    for placement in (None, "device"):
        _, moe, block = bodies_of("mtp", placement)
        assert block.length is None and block.names == moe.names == collections.Counter(BOTH + MOE_ONLY)
        assert block.checkpointed == moe.checkpointed == (placement is not None)


def test_fields_are_a_typed_dataclass():
    assert [f.name for f in dataclasses.fields(P)] == list(NAMES)
    assert all(f.type == "Placement" for f in dataclasses.fields(P))
    assert placement_map_for(zoo.DeepseekV3) is P and zoo.DeepseekV3Placement is P
    assert layer_policy("nvidia_offload", tiny()) is P.preset("nvidia_offload").policy()
    with pytest.raises(PlacementError, match="a LlamaPlacement places the tensors of Llama, not of a DeepseekV3"):
        lm(tiny(), tiny_ids(), zoo.LlamaPlacement())
    with pytest.raises(PlacementError, match=r"no tensor named 'moe_upp' \(did you mean 'moe_up'\?\)"):
        P.parse("remat+moe_upp=pinned_host")


# -- every name matters --------------------------------------------------------------------


def residuals(loss, model, ids, placement) -> collections.Counter:
    """What the backward pass keeps, as ``dtype<memory>[shape]`` strings (``<host>`` marks
    pinned host memory), from ``jax.ad_checkpoint.print_saved_residuals``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda m: loss(m, ids, placement), model)
    return collections.Counter(line.split(" ", 1)[0] for line in out.getvalue().splitlines())


@functools.cache
def residuals_of(kind: str, placement: DeepseekV3Placement) -> collections.Counter:
    return residuals(loss_of(kind), model_of(kind), tiny_ids(), placement)


def check_flip(kind: str, base: DeepseekV3Placement, name: str) -> None:
    """From ``base`` with ``name`` on device: remat drops exactly that tensor's residuals (one
    per body holding it) and adds nothing; pinned_host moves exactly them to host memory."""
    bodies = bodies_of(kind)
    mine = residual_of(bodies, name)
    on_device = residuals_of(kind, dataclasses.replace(base, **{name: "device"}))
    assert mine and not mine - on_device, (name, mine)
    if "remat" in P.choices(name):
        rematted = residuals_of(kind, dataclasses.replace(base, **{name: "remat"}))
        assert on_device - rematted == mine, name
        assert rematted - on_device == collections.Counter(), name
    offloaded = residuals_of(kind, dataclasses.replace(base, **{name: "pinned_host"}))
    assert on_device - offloaded == mine, name
    assert offloaded - on_device == residual_of(bodies, name, host=True), name


@pytest.mark.parametrize(("impl", "name"), [("ragged_dot", "moe_out"), ("ragged_dot", "moe_gate"), ("dense", "moe_up")])
def test_names_matter_on_the_other_expert_paths(impl, name):
    check_flip(impl, P.preset("remat"), name)


@pytest.mark.parametrize("name", ["layer_input", "moe_out"])
def test_names_matter_in_the_mtp_block_too(name):
    """Three bodies each: the dense scan, the MoE scan and the MTP block (whose input, the
    argument of its checkpointed function, behaves as a scan carry does)."""
    check_flip("mtp", P.preset("save_matmuls"), name)


def test_the_swiglu_down_projections_would_be_dead_names(monkeypatch):
    """Why the dense and shared experts' down projections have no name: they only feed adds,
    so saving them leaves the backward pass unchanged. (The routed experts' outputs, which
    the combine's gradient needs, are ``moe_out``; test_every_name_... shows it matters.)"""
    model, ids = tiny(), tiny_ids()
    real = zoo.layers.mlp.swiglu

    def named(*a, **k):
        return jax.ad_checkpoint.checkpoint_name(real(*a, **k), "down")

    monkeypatch.setattr(zoo.deepseek_v3.layer, "swiglu", named)
    monkeypatch.setattr(zoo.deepseek_v3.model, "layer_policy", lambda policy, model: policy)
    assert sum(b.names["down"] for b in layer_bodies(lm, model, ids, None)) == 2  # dense MLP, shared experts
    save = jax.checkpoint_policies.save_only_these_names(*NAMES, "down")
    skip = jax.checkpoint_policies.save_only_these_names(*NAMES)
    assert residuals(lm, model, ids, save) == residuals(lm, model, ids, skip)


# -- numerics never change -------------------------------------------------------------------


@functools.cache
def grads(kind: str, placements: tuple) -> list:
    """``(loss, gradients)`` for each placement, all from one compiled program (one compile
    instead of one per map: the suite is dominated by XLA's compile time)."""
    loss = loss_of(kind)
    f = jax.jit(lambda m, ids: [eqx.filter_value_and_grad(loss)(m, ids, p) for p in placements], compiler_options=FAST)
    return f(model_of(kind), tiny_ids())


# The programs holding each kind's no-map reference (with the maps they test).
REFERENCE = {
    "grouped": (None, *(P.preset(name) for name in PRESETS)),
    "tiled": (None, P.parse("nvidia_offload+moe_up=device")),
    "ragged_dot": (None, P.parse("nvidia_offload+moe_out=pinned_host,router_logits=device")),
    "dense": (None, P.parse("nvidia_offload+router_logits=device")),
    "mtp": (None, P.preset("nvidia_offload")),
}


def check_same_gradients(kind: str, placements: tuple) -> None:
    """Every placement's loss and gradients equal those without a map (1e-6 relative, float32);
    on the fixture, the gradient norm is transformers' (1e-5)."""
    ref_loss, ref = grads(kind, REFERENCE[kind])[0]
    program = REFERENCE[kind] if placements == REFERENCE[kind][1:] else placements
    results = grads(kind, program)[-len(placements) :]
    assert len(results) == len(placements) >= 1
    for placement, (loss, g) in zip(placements, results):
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(ref)):
            scale = float(jnp.linalg.norm(b))
            err = float(jnp.linalg.norm(a - b)) / scale if scale else float(jnp.linalg.norm(a))
            assert err <= 1e-6, f"{placement}: gradient of {jax.tree_util.keystr(path)} off by {err:.2e} relative"
        if kind != "mtp":
            np.testing.assert_allclose(global_norm(g), float(reference("deepseek_v3-tiny")["grad_norm"]), rtol=1e-5)


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot", "dense"])
def test_other_expert_paths_give_the_same_gradients(impl):
    check_same_gradients(impl, REFERENCE[impl][1:])


def test_the_mtp_block_keeps_its_gradients():
    """deepseek_v3_loss with the MTP term: its block now runs under the map's checkpoint."""
    _, ref = grads("mtp", REFERENCE["mtp"])[0]
    assert global_norm(ref.mtp) > 0  # the block's gradients are compared, not vacuous
    check_same_gradients("mtp", REFERENCE["mtp"][1:])


# -- the CUDA program moves exactly the offloaded names, per scanned body ---------------------


@functools.cache
def cuda_training_step(kind: str, placement) -> str:
    loss = loss_of(kind)
    step = jax.jit(lambda m, ids: eqx.filter_value_and_grad(loss)(m, ids, placement))
    return jax.export.export(step, platforms=["cuda"])(model_of(kind), tiny_ids()).mlir_module()


def check_round_trips(placement: DeepseekV3Placement, kind: str = "grouped") -> None:
    """Each scanned body's forward loop: one copy to pinned host per offloaded name it holds;
    its backward loop: one copy back per such name; the MTP block's outside the loops;
    nothing else anywhere."""
    bodies = bodies_of(kind)
    loops, total = placement_annotations(cuda_training_step(kind, placement))
    busy = [c for c in loops if c]

    def moves(body: Body, where: str) -> collections.Counter:
        off = [n for n in placement.placed("pinned_host") if n in body.names]
        return collections.Counter((where, tensor_type(body.shapes[n])) for n in off)

    scanned = [b for b in bodies if b.length is not None]
    expected = [moves(b, "pinned_host") for b in scanned] + [moves(b, "device") for b in reversed(scanned)]
    assert busy == [c for c in expected if c], busy
    outside = [moves(b, w) for b in bodies if b.length is None for w in ("pinned_host", "device")]
    assert total == sum(expected + outside, collections.Counter())
    if not placement.placed("pinned_host"):
        assert total == collections.Counter() and busy == []


def test_cuda_program_offloads_everything():
    """Every name at once: the dense loops move the attention and dense-MLP names, the MoE
    loops the attention, router and expert names (same-shaped names add up per type)."""
    everything = P(**{n: "pinned_host" for n in NAMES})
    check_round_trips(everything)
    loops, _ = placement_annotations(cuda_training_step("grouped", everything))
    assert [sum(c.values()) for c in loops if c] == [16, 21, 21, 16]  # dense fwd, MoE fwd, MoE bwd, dense bwd
    assert len(BOTH + DENSE_ONLY) == 16 and len(BOTH + MOE_ONLY) == 21


def test_cuda_program_offloads_the_mtp_block_outside_the_loops():
    check_round_trips(P.preset("nvidia_offload"), "mtp")


# -- memory moves the right way ----------------------------------------------------------------

# Names moved to remat together, one compile per group, in data-flow order: attention (both
# layer kinds), the dense MLP, router and routed experts, shared experts. (One name at a time,
# every step lowered the temp bytes too when measured; 22 compiles are too slow for the suite.)
GROUPS = (tuple(n for n in BOTH if n != "layer_input"), DENSE_ONLY, MOE_ONLY[:5], MOE_ONLY[5:])


def test_device_memory_falls_as_names_move_to_remat():
    """Compiled temp bytes of the training step on a deeper, longer model: each group of names
    moved from device to remat lowers them, and full remat is far below everything on device."""
    config = preset("tiny", num_layers=16, first_k_dense_replace=4, num_nextn_predict_layers=0)
    model = jax.eval_shape(lambda: zoo.DeepseekV3(config, key=jr.key(0), expert_impl="grouped"))
    ids = jax.ShapeDtypeStruct((4, 128), jnp.int32)

    def temp(placement) -> int:
        step = jax.jit(lambda m, ids: eqx.filter_value_and_grad(lm)(m, ids, placement))
        return step.lower(model, ids).compile(FAST).memory_analysis().temp_size_in_bytes

    assert sorted(n for g in GROUPS for n in g) == sorted(n for n in NAMES if n != "layer_input")
    chain = [P.preset("device")]
    for group in GROUPS:
        chain.append(dataclasses.replace(chain[-1], **{n: "remat" for n in group}))
    assert chain[-1] == P.preset("remat")
    sizes = [temp(placement) for placement in chain]
    assert all(a > b for a, b in itertools.pairwise(sizes)), sizes
    assert sizes[-1] * 3 < sizes[0], sizes


# -- presets -------------------------------------------------------------------------------------


def test_presets():
    assert PRESETS == ("device", "remat", "save_matmuls", "nvidia_offload", "maxtext_offload")
    remat = P.preset("remat")
    assert remat.placed("device") == ("layer_input",) and len(remat.placed("remat")) == len(NAMES) - 1
    save = P.preset("save_matmuls")
    assert save.placed("remat") == (
        "attn_norm", "q_latent", "kv_latent", "mlp_norm", "mlp_hidden", "moe_hidden", "shared_hidden"
    )  # fmt: skip
    nvidia = P.preset("nvidia_offload")
    mla = ("q_a", "q_latent", "kv_a", "kv_latent", "query", "key", "value")
    assert nvidia.placed("pinned_host") == (*mla, "moe_gate", "moe_up")
    assert nvidia.placed("device") == ("layer_input",)
    for name in PRESETS:
        assert P.parse(P.preset(name).spec()) == P.preset(name)
