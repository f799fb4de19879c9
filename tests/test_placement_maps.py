"""Every family's placement map, by the same tests: one source of truth with the model code, every
name matters, numerics never change, the CUDA program moves exactly the offloaded names in each
scanned body, memory falls with remat.

Runs on one ``transformers`` fixture per registered model type (``families.py``). The map
mechanism itself (parsing, presets, errors, parameter and optimizer memory) is
``test_placement.py``'s; what only one family has (DeepSeek-V3's expert paths and MTP block) is
in that family's own placement tests."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import sys
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from families import MODEL_TYPES, grad_norm_reference, tiny, tiny_ids
from helpers import global_norm
from hypothesis import given, settings
from hypothesis import strategies as st
from test_placement import FAST, placement_annotations, tensor_type

import zoo
from zoo import registry
from zoo.placement import PlacementError, layer_policy, placement_map_for, subjaxprs

# Its numerics tests run offloading maps in this process (conftest.py orders these last).
pytestmark = pytest.mark.host_memory


def map_of(model_type: str):
    return placement_map_for(tiny(model_type))


def lm(m, ids, placement):
    return zoo.lm_loss(m, ids, placement=placement)


def maps(model_type: str) -> st.SearchStrategy:
    """Random maps: every field any placement it accepts."""
    P = map_of(model_type)
    return st.builds(P, **{n: st.sampled_from(P.choices(n)) for n in P.names()})


def test_every_registered_model_type_is_under_test():
    assert set(MODEL_TYPES) == set(registry.model_types())


# -- where the names are ------------------------------------------------------------------------


class Body(NamedTuple):
    """The named tensors of one layer body: a scan over ``length`` layers, or (``None``) a block
    outside any scan; ``checkpointed``: every name inside it sits in a jax.checkpoint."""

    length: int | None
    names: collections.Counter  # name -> occurrences
    shapes: dict  # name -> jax.ShapeDtypeStruct
    checkpointed: bool


def layer_bodies(loss, model, ids, placement="device") -> list[Body]:
    """Every ``checkpoint_name`` of the traced loss, grouped by the layer scan holding it (in
    trace order), then those outside any scan."""
    found: dict = {}

    def walk(jaxpr, body, length, ckpt):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                aval = eqn.outvars[0].aval
                entry = found.setdefault(body, (length, collections.Counter(), {}, []))
                entry[1][eqn.params["name"]] += 1
                entry[2][eqn.params["name"]] = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
                entry[3].append(ckpt)
            in_scan = body is None and eqn.primitive.name == "scan"
            for sub in subjaxprs(eqn):
                walk(
                    sub,
                    id(eqn) if in_scan else body,
                    eqn.params["length"] if in_scan else length,
                    ckpt or eqn.primitive.name in ("remat2", "checkpoint"),  # jax.checkpoint's primitive
                )

    walk(jax.make_jaxpr(lambda m: loss(m, ids, placement))(model).jaxpr, None, None, False)
    bodies = [Body(n, c, s, all(k)) for key, (n, c, s, k) in found.items() if key is not None]
    if None in found:
        n, c, s, k = found[None]
        bodies.append(Body(n, c, s, all(k)))
    return bodies


@functools.cache
def bodies_of(model_type: str, placement="device") -> list[Body]:
    return layer_bodies(lm, tiny(model_type), tiny_ids(model_type), placement)


def names_in(model_type: str) -> list[str]:
    """The map's names this family's fixture has, in field order (a dense Qwen3 has no router)."""
    present = set().union(*(b.names for b in bodies_of(model_type)))
    return [n for n in map_of(model_type).names() if n in present]


CASES_BY_NAME = [(t, n) for t in MODEL_TYPES for n in names_in(t)]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("placement", [None, "device", "remat", "save_matmuls"])
def test_fields_are_exactly_the_names_in_the_model(model_type, placement):
    """Every checkpoint_name of the model is a field, at most once per layer of a layer body (a
    body runs one layer, or a repeat of several: Qwen3's alternating dense and MoE layers), each
    body under jax.checkpoint as soon as a map is given; every field names a tensor of some
    family fixture with this map (no dead field)."""
    P = map_of(model_type)
    bodies = bodies_of(model_type, placement)
    assert bodies and all(b.length is not None for b in bodies)  # every layer runs in a scan
    for b in bodies:
        layers = b.names["layer_input"]  # one per layer
        assert set(b.names) <= set(P.names()) and layers >= 1 and max(b.names.values()) <= layers, b.names
        assert b.checkpointed == (placement is not None)
    covered = set().union(*(names_in(t) for t in MODEL_TYPES if map_of(t) is P))
    assert covered == set(P.names())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fields_are_a_typed_dataclass(model_type):
    P = map_of(model_type)
    assert dataclasses.is_dataclass(P) and P is type(tiny(model_type)).placement_map
    assert all(f.type == "Placement" for f in dataclasses.fields(P))
    assert getattr(zoo.placement, P.__name__) is P  # the old import path still works
    assert layer_policy("remat", tiny(model_type)) is P.preset("remat").policy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        P().layer_input = "remat"  # type: ignore[misc]
    for other in {map_of(t) for t in MODEL_TYPES} - {P}:
        with pytest.raises(PlacementError, match=f"a {other.__name__} places the tensors of"):
            lm(tiny(model_type), tiny_ids(model_type), other())


# -- every name matters ---------------------------------------------------------------------------


def residuals(model, ids, placement) -> collections.Counter:
    """What the backward pass keeps, as ``dtype<memory>[shape]`` strings (``<host>`` marks
    pinned host memory), from ``jax.ad_checkpoint.print_saved_residuals``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda m: lm(m, ids, placement), model)
    return collections.Counter(line.split(" ", 1)[0] for line in out.getvalue().splitlines())


@functools.cache
def residuals_of(model_type: str, placement) -> collections.Counter:
    return residuals(tiny(model_type), tiny_ids(model_type), placement)


def residual_of(bodies: list[Body], name: str, *, host: bool = False) -> collections.Counter:
    """The residuals one named tensor becomes: one per body holding it, stacked over its layers."""
    out: collections.Counter = collections.Counter()
    for body in bodies:
        if name in body.names:
            s = body.shapes[name]
            dtype = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16"}[jnp.dtype(s.dtype)]
            shape = s.shape if body.length is None else (body.length, *s.shape)  # a block outside the scans: unstacked
            out[f"{dtype}{'<host>' if host else ''}[{','.join(map(str, shape))}]"] += body.names[name]
    return out


def check_flip(model_type: str, base, name: str) -> None:
    """From ``base`` with ``name`` on device: remat drops exactly that tensor's residuals (one
    per body holding it) and adds nothing; pinned_host moves exactly them to host memory."""
    P, bodies = map_of(model_type), bodies_of(model_type)
    mine = residual_of(bodies, name)
    on_device = residuals_of(model_type, dataclasses.replace(base, **{name: "device"}))
    assert mine and not mine - on_device, (name, mine)
    if "remat" in P.choices(name):
        rematted = residuals_of(model_type, dataclasses.replace(base, **{name: "remat"}))
        assert on_device - rematted == mine, name
        assert rematted - on_device == collections.Counter(), name
    offloaded = residuals_of(model_type, dataclasses.replace(base, **{name: "pinned_host"}))
    assert on_device - offloaded == mine, name
    assert offloaded - on_device == residual_of(bodies, name, host=True), name


@pytest.mark.parametrize("model_type, name", CASES_BY_NAME, ids=[f"{t}-{n}" for t, n in CASES_BY_NAME])
def test_every_name_changes_what_the_backward_pass_keeps(model_type, name):
    check_flip(model_type, map_of(model_type).preset("device"), name)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_every_name_matters_whatever_the_rest(model_type, data):
    base = data.draw(maps(model_type))
    check_flip(model_type, base, data.draw(st.sampled_from(names_in(model_type))))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_layer_input_refuses_remat_because_it_cannot_be_recomputed(model_type, monkeypatch):
    """The layer input is the scan carry, the checkpointed body's argument: dropping it from
    the saved names changes nothing, so 'remat' (which would silently mean 'device') is refused.
    (Where a body runs several layers, only the later layers' inputs are not the carry: exactly
    those residuals go.)"""
    P, model, ids = map_of(model_type), tiny(model_type), tiny_ids(model_type)
    rest = [n for n in P.names() if n != "layer_input"]
    # The model module looks the policy up by its own name: a jax policy passes straight through.
    monkeypatch.setattr(sys.modules[type(model).__module__], "layer_policy", lambda policy, model: policy)
    keep = jax.checkpoint_policies.save_only_these_names(*P.names())
    drop = jax.checkpoint_policies.save_only_these_names(*rest)
    later_inputs = collections.Counter()
    for body in bodies_of(model_type):
        one = residual_of([body], "layer_input")
        later_inputs += collections.Counter({k: v // body.names["layer_input"] * (body.names["layer_input"] - 1) for k, v in one.items()})
    kept, dropped = residuals(model, ids, keep), residuals(model, ids, drop)
    assert kept - dropped == later_inputs and dropped - kept == collections.Counter()
    monkeypatch.undo()
    with pytest.raises(PlacementError, match="layer_input cannot be 'remat': the layer input is the scan carry"):
        P.parse("device+layer_input=remat")
    assert P.choices("layer_input") == ("device", "pinned_host")
    assert all(P.choices(n) == ("device", "remat", "pinned_host") for n in rest)


# -- numerics never change ---------------------------------------------------------------------------


@functools.cache
def grads(model_type: str, placements: tuple) -> list:
    """``(loss, gradients)`` for each placement, all from one compiled program (one compile
    instead of one per map: the suite is dominated by XLA's compile time)."""
    f = jax.jit(lambda m, ids: [eqx.filter_value_and_grad(lm)(m, ids, p) for p in placements], compiler_options=FAST)
    return f(tiny(model_type), tiny_ids(model_type))


def presets_program(model_type: str) -> tuple:
    P = map_of(model_type)
    return (None, *(P.preset(name) for name in P.preset_names()))


def check_same_gradients(model_type: str, placements: tuple, results: list, reference) -> None:
    """Every placement's loss and gradients equal those without a map (1e-6 relative, float32)."""
    ref_loss, ref = reference
    assert len(results) == len(placements) >= 1
    for placement, (loss, g) in zip(placements, results):
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(ref)):
            scale = float(jnp.linalg.norm(b))
            err = float(jnp.linalg.norm(a - b)) / scale if scale else float(jnp.linalg.norm(a))
            assert err <= 1e-6, f"{placement}: gradient of {jax.tree_util.keystr(path)} off by {err:.2e} relative"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_presets_give_the_same_gradients(model_type):
    program = presets_program(model_type)
    results = grads(model_type, program)
    check_same_gradients(model_type, program[1:], results[1:], results[0])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_no_map_matches_transformers(model_type):
    # Its own small program: under pytest-xdist the presets' program (~25 s to compile) is often
    # on the other worker.
    _, g = grads(model_type, (None,))[0]
    np.testing.assert_allclose(global_norm(g), grad_norm_reference(model_type), rtol=1e-5)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_random_maps_give_the_same_gradients(model_type, data):
    placements = tuple(data.draw(st.lists(maps(model_type), min_size=2, max_size=2, unique=True)))
    results = grads(model_type, (None, *placements))
    check_same_gradients(model_type, placements, results[1:], results[0])


# -- the CUDA program moves exactly the offloaded names, per scanned body ---------------------------


@functools.cache
def cuda_training_step(model_type: str, placement) -> str:
    step = jax.jit(lambda m, ids: eqx.filter_value_and_grad(lm)(m, ids, placement))
    return jax.export.export(step, platforms=["cuda"])(tiny(model_type), tiny_ids(model_type)).mlir_module()


def check_round_trips(model_type: str, placement) -> None:
    """Each scanned body's forward loop: one copy to pinned host per offloaded name it holds;
    its backward loop: one copy back per such name; nothing else anywhere."""
    bodies = bodies_of(model_type)
    loops, total = placement_annotations(cuda_training_step(model_type, placement))
    busy = [c for c in loops if c]

    def moves(body: Body, where: str) -> collections.Counter:
        off = [n for n in placement.placed("pinned_host") if n in body.names]
        return sum((collections.Counter({(where, tensor_type(body.shapes[n])): body.names[n]}) for n in off), collections.Counter())

    expected = [moves(b, "pinned_host") for b in bodies] + [moves(b, "device") for b in reversed(bodies)]
    assert busy == [c for c in expected if c], busy
    assert total == sum(expected, collections.Counter())
    if not placement.placed("pinned_host"):
        assert total == collections.Counter() and busy == []


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cuda_program_offloads_one_name_per_body(model_type):
    P = map_of(model_type)
    last = names_in(model_type)[-1]  # the deepest name of the layer (its MLP or experts)
    check_round_trips(model_type, dataclasses.replace(P.preset("save_matmuls"), **{last: "pinned_host"}))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cuda_program_offloads_each_preset(model_type):
    P = map_of(model_type)
    for name in P.preset_names():
        check_round_trips(model_type, P.preset(name))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cuda_program_offloads_everything(model_type):
    P = map_of(model_type)
    check_round_trips(model_type, P(**{n: "pinned_host" for n in P.names()}))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_no_map_means_no_checkpoint_and_no_transfers(model_type):
    mlir = cuda_training_step(model_type, None)
    assert "annotate_device_placement" not in mlir
    _, total = placement_annotations(mlir)
    assert total == collections.Counter()


# -- memory moves the right way --------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_full_remat_needs_less_device_memory_than_keeping_everything(model_type):
    """Compiled temp bytes of the training step of the fixture's architecture grown to 8 layers,
    at 4 x 128 tokens: full remat well below everything on device (the per-name chains are in
    the families' own tests)."""
    P, fixture = map_of(model_type), tiny(model_type)
    config = dataclasses.replace(fixture.config, num_layers=8)
    model = jax.eval_shape(lambda: type(fixture)(config, key=jax.random.key(0)))
    ids = jax.ShapeDtypeStruct((4, 128), jnp.int32)

    def temp(placement) -> int:
        step = jax.jit(lambda m, ids: eqx.filter_value_and_grad(lm)(m, ids, placement))
        return step.lower(model, ids).compile(FAST).memory_analysis().temp_size_in_bytes

    device, remat = temp(P.preset("device")), temp(P.preset("remat"))
    assert remat * 1.5 < device, (device, remat)
