"""Parallelism on 8 CPU devices: one sharded step equals the single-device step, layouts
follow the parameter description, per-device bytes shrink as the layout says, FSDP keeps one
layer's full weights at a time, and bad meshes fail naming the culprit."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import free_port, run_in_fresh_process

import zoo
from zoo import parallel, registry
from zoo.deepseek_v3 import deepseek_v3_loss
from zoo.layers.moe_dispatch import slot_rows
from zoo.deepseek_v3 import preset as deepseek_preset
from zoo.llama import preset as llama_preset
from zoo.parallel import MeshError
from zoo.qwen3 import preset as qwen3_preset

ROOT = Path(__file__).resolve().parents[1]

# The layouts written out by hand (size-1 axes included): what partition_specs must derive
# from the models' Param letters. "-" is a dimension kept whole; "fsdp+expert" one split over
# both (fsdp outermost): the MoE families' weights outside the routed experts are stored split
# over the expert group too, which splits the batch like fsdp (zoo.core.mesh.WEIGHT_SHARDS).
LLAMA_LAYOUT = {
    "embed": "fsdp -",
    "layers.attn_norm": "- fsdp",
    "layers.attn.wq": "- fsdp tensor -",
    "layers.attn.wk": "- fsdp tensor -",
    "layers.attn.wv": "- fsdp tensor -",
    "layers.attn.wo": "- tensor - fsdp",
    "layers.mlp_norm": "- fsdp",
    "layers.mlp.w_gate": "- fsdp tensor",
    "layers.mlp.w_up": "- fsdp tensor",
    "layers.mlp.w_down": "- tensor fsdp",
    "final_norm": "fsdp",
    "head": "fsdp -",
}
_MLA = {
    "attn_norm": "fsdp+expert",
    "attn.wq_a": "fsdp+expert -",
    "attn.q_norm": "fsdp+expert",
    "attn.wq_b": "fsdp+expert tensor -",
    "attn.wkv_a": "fsdp+expert -",
    "attn.kv_norm": "fsdp+expert",
    "attn.wkv_b": "fsdp+expert tensor -",
    "attn.wo": "tensor - fsdp+expert",
    "mlp_norm": "fsdp+expert",
}
_MOE = {
    "moe.router": "fsdp+expert -",
    "moe.router_bias": "-",
    # A routed expert's weights: E over the expert group, the hidden dimension over fsdp alone.
    "moe.w_gate": "expert fsdp tensor",
    "moe.w_up": "expert fsdp tensor",
    "moe.w_down": "expert tensor fsdp",
    "moe.shared.w_gate": "fsdp+expert tensor",
    "moe.shared.w_up": "fsdp+expert tensor",
    "moe.shared.w_down": "tensor fsdp+expert",
}
DEEPSEEK_LAYOUT = {
    # The vocabulary takes fsdp (zoo.vocab_parallel streams it); the expert group the hidden dimension.
    "embed": "fsdp expert",
    **{f"dense_layers.{k}": f"- {v}" for k, v in _MLA.items()},
    "dense_layers.mlp.w_gate": "- fsdp+expert tensor",
    "dense_layers.mlp.w_up": "- fsdp+expert tensor",
    "dense_layers.mlp.w_down": "- tensor fsdp+expert",
    **{f"moe_layers.{k}": f"- {v}" for k, v in {**_MLA, **_MOE}.items()},
    "final_norm": "fsdp+expert",
    "head": "fsdp expert",
    "mtp.enorm": "fsdp+expert",
    "mtp.hnorm": "fsdp+expert",
    "mtp.proj": "- fsdp+expert",
    "mtp.final_norm": "fsdp+expert",
    **{f"mtp.block.{k}": v for k, v in {**_MLA, **_MOE}.items()},
}
_QK = {
    "attn_norm": "fsdp+expert",
    "attn.wq": "fsdp+expert tensor -",
    "attn.wk": "fsdp+expert tensor -",
    "attn.wv": "fsdp+expert tensor -",
    "attn.wo": "tensor - fsdp+expert",
    "attn.q_norm": "-",
    "attn.k_norm": "-",
    "mlp_norm": "fsdp+expert",
}
_DENSE_MLP = {"mlp.w_gate": "fsdp+expert tensor", "mlp.w_up": "fsdp+expert tensor", "mlp.w_down": "tensor fsdp+expert"}
_QWEN_MOE = {
    "moe.router": "fsdp+expert -",
    "moe.w_gate": "expert fsdp tensor",
    "moe.w_up": "expert fsdp tensor",
    "moe.w_down": "expert tensor fsdp",
}
QWEN3_LAYOUT = {
    "embed": "fsdp expert",
    **{f"dense_layers.{k}": f"- {v}" for k, v in {**_QK, **_DENSE_MLP}.items()},
    "final_norm": "fsdp+expert",
}
QWEN3_MOE_LAYOUT = {
    **QWEN3_LAYOUT,
    **{f"moe_layers.{k}": f"- {v}" for k, v in {**_QK, **_QWEN_MOE}.items()},
    "head": "fsdp expert",
}
LAYOUT = {"llama": LLAMA_LAYOUT, "deepseek_v3": DEEPSEEK_LAYOUT, "qwen3": QWEN3_LAYOUT, "qwen3_moe": QWEN3_MOE_LAYOUT}


def expected_spec(layout: str, mesh) -> tuple:
    def entry(word: str):
        axes = tuple(a for a in word.split("+") if a != "-" and mesh.shape[a] > 1)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return tuple(entry(word) for word in layout.split())


def split_by(layout: str, mesh) -> int:
    """Devices a parameter of hand-written ``layout`` is split over on ``mesh``."""
    return math.prod(mesh.shape[a] for e in expected_spec(layout, mesh) for a in parallel.axis_names(e))


@functools.cache
def llama():
    return zoo.Llama(llama_preset("tiny"), key=jax.random.key(0))


@functools.cache
def deepseek():
    return zoo.DeepseekV3(deepseek_preset("tiny", mtp=True), key=jax.random.key(0))


@functools.cache
def qwen3(model_type: str):
    """Dense Qwen3 (tied head), or Qwen3-MoE with a dense first layer then MoE layers."""
    return zoo.Qwen3(qwen3_preset("tiny", model_type), key=jax.random.key(0))


def training_loss(m, ids, **kwargs):
    """The family's own training objective and metrics (``model.loss``)."""
    return m.loss(ids, **kwargs)


def batch(model, b: int = 8, s: int = 16):
    return jax.random.randint(jax.random.key(1), (b, s), 0, model.config.vocab_size, dtype=jnp.int32)


@functools.cache
def reference(name: str):
    """Loss (and aux) and gradients of the single-device step."""
    model, loss_fn, has_aux = MODELS[name]()
    return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=has_aux))(model, batch(model))


# Every registered model type, each with its training objective.
MODELS = {
    "llama": lambda: (llama(), zoo.lm_loss, False),
    "deepseek_v3": lambda: (deepseek(), deepseek_v3_loss, True),
    "qwen3": lambda: (qwen3("qwen3"), training_loss, True),
    "qwen3_moe": lambda: (qwen3("qwen3_moe"), training_loss, True),
}


def test_every_registered_model_type_is_under_test():
    assert set(MODELS) == set(LAYOUT) == set(registry.model_types())


def flat(tree) -> dict:
    """``{path: leaf}`` for the array (or PartitionSpec) leaves of a model-shaped tree."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    return {".".join(str(getattr(k, "name", k)) for k in path): x for path, x in leaves}


# -- mesh spec ----------------------------------------------------------------------------


def test_parse_mesh():
    assert parallel.parse_mesh("data=2,fsdp=2,tensor=2") == {"pipeline": 1, "data": 2, "fsdp": 2, "context": 1, "tensor": 2,
                                                              "expert": 1}  # fmt: skip
    assert parallel.parse_mesh("") == {"pipeline": 1, "data": 1, "fsdp": 1, "context": 1, "tensor": 1, "expert": 1}
    assert parallel.parse_mesh(" expert = 4 , fsdp=2 ,") == {"pipeline": 1, "data": 1, "fsdp": 2, "context": 1, "tensor": 1,
                                                            "expert": 4}  # fmt: skip
    assert parallel.parse_mesh("pipeline=4,fsdp=2")["pipeline"] == 4
    assert parallel.parse_mesh("context=4,data=2")["context"] == 4
    with pytest.raises(MeshError, match=r"unknown mesh axis 'fsdb' \(did you mean 'fsdp'\?\)"):
        parallel.parse_mesh("data=2,fsdb=4")
    with pytest.raises(MeshError, match=r"size of axis 'tensor' must be an integer, got 'two'"):
        parallel.parse_mesh("tensor=two")
    with pytest.raises(MeshError, match=r"size of axis 'data' must be >= 1, got 0"):
        parallel.parse_mesh("data=0")
    with pytest.raises(MeshError, match=r"axis 'data' given twice"):
        parallel.parse_mesh("data=2,data=4")
    with pytest.raises(MeshError, match=r"'fsdp' is not axis=size"):
        parallel.parse_mesh("fsdp")


def test_make_mesh():
    mesh = parallel.make_mesh("fsdp=4,tensor=2")
    assert mesh.axis_names == parallel.AXES
    assert dict(mesh.shape) == {"pipeline": 1, "data": 1, "fsdp": 4, "context": 1, "tensor": 2, "expert": 1}
    assert parallel.make_mesh({"expert": 4}, devices=jax.devices()[:4]).devices.size == 4
    with pytest.raises(MeshError, match=r"data=1 x fsdp=2 x context=1 x tensor=2 x expert=1 has 4 devices but 8 are available"):
        parallel.make_mesh("fsdp=2,tensor=2")
    with pytest.raises(MeshError, match=r"unknown mesh axis 'experts' \(did you mean 'expert'\?\)"):
        parallel.make_mesh({"experts": 8})


def test_validate_mesh_names_the_field():
    mesh = parallel.make_mesh
    cases = [
        (llama_preset("tiny"), "tensor=8", r"LlamaConfig.num_heads = 4 is not divisible by mesh axis 'tensor' of size 8"),
        (dataclasses.replace(llama_preset("tiny"), num_heads=8, num_kv_heads=2), "tensor=4,data=2",
         r"LlamaConfig.num_kv_heads = 2 is not divisible by mesh axis 'tensor' of size 4"),
        (llama_preset("tiny"), "expert=8", r"mesh axis 'expert' has size 8 but LlamaConfig has no experts"),
        (deepseek_preset("tiny", n_routed_experts=12), "expert=8",
         r"DeepseekV3Config.n_routed_experts = 12 is not divisible by mesh axis 'expert' of size 8"),
        (deepseek_preset("tiny", kv_lora_rank=12), "fsdp=8",
         r"DeepseekV3Config.kv_lora_rank = 12 is not divisible by mesh axis 'fsdp' of size 8"),
        (deepseek_preset("tiny", moe_intermediate_size=36), "tensor=8",
         r"DeepseekV3Config.num_heads = 4 is not divisible"),
    ]  # fmt: skip
    for config, spec, message in cases:
        with pytest.raises(MeshError, match=message):
            parallel.validate_mesh(mesh(spec), config)
    # The vocabulary and MLP widths are padded instead (tests/test_vocab_parallel.py).
    for config, spec in [
        (dataclasses.replace(llama_preset("tiny"), num_heads=8, num_kv_heads=8, intermediate_size=100), "tensor=8"),
        (dataclasses.replace(llama_preset("tiny"), vocab_size=100), "fsdp=8"),
        (deepseek_preset("tiny", num_heads=8, moe_intermediate_size=36), "tensor=8"),
    ]:
        parallel.validate_mesh(mesh(spec), config)
    parallel.validate_mesh(mesh("fsdp=2,expert=4"), deepseek_preset("tiny"))  # fits: no error
    parallel.validate_mesh(mesh("fsdp=4,tensor=2"), llama())  # a model works as well as its config


# -- layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUT))
def test_partition_specs_follow_the_param_letters(name):
    model, layout = MODELS[name]()[0], LAYOUT[name]
    for spec in ("fsdp=4,tensor=2", "fsdp=2,expert=4"):
        mesh = parallel.make_mesh(spec)
        if name in ("llama", "qwen3") and "expert" in spec:
            continue
        specs = flat(parallel.partition_specs(model, mesh))
        assert set(specs) == set(flat(model)) == set(layout)
        for path, s in specs.items():
            assert tuple(s) == expected_spec(layout[path], mesh), (spec, path)
    # Any tree holding models: an optimizer state's moments get the model's layout.
    mesh = parallel.make_mesh("fsdp=8")
    state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_inexact_array))
    specs = parallel.partition_specs(state, mesh)
    assert tuple(specs[0].mu.embed) == ("fsdp", None) and tuple(specs[0].count) == ()


def test_shard_places_every_array_and_passes_memory_kind():
    model, mesh = llama(), parallel.make_mesh("fsdp=4,tensor=2")
    sharded = parallel.shard(model, mesh)
    for path, x in flat(sharded).items():
        assert x.sharding.spec == jax.sharding.PartitionSpec(*expected_spec(LLAMA_LAYOUT[path], mesh)), path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(flat(model)[path]))
    # memory_kind= reaches every array (in a fresh process: helpers.run_in_fresh_process).
    assert run_in_fresh_process(SHARD_TO_HOST).strip().endswith("ok")


SHARD_TO_HOST = """
import test_parallel as t
host = t.parallel.shard(t.llama(), t.parallel.make_mesh("fsdp=4,tensor=2"), memory_kind="pinned_host")
assert {x.sharding.memory_kind for x in jax.tree.leaves(host)} == {"pinned_host"}
print("ok")
"""


# -- one step equals the single-device step -------------------------------------------------

LAYOUTS = [
    # model, mesh, batch axes, extra loss kwargs (expert_impl: the sharded model's expert kernel)
    ("llama", "data=8", parallel.BATCH_AXES, {}),
    ("llama", "fsdp=4,tensor=2", parallel.BATCH_AXES, {"placement": "save_matmuls"}),
    ("llama", "data=2,fsdp=2,tensor=2", parallel.BATCH_AXES, {}),
    ("deepseek_v3", "data=8", parallel.BATCH_AXES, {}),
    ("deepseek_v3", "fsdp=4,tensor=2", parallel.BATCH_AXES, {}),
    ("deepseek_v3", "fsdp=2,expert=4", parallel.BATCH_AXES, {}),  # tokens split over the expert group
    # The dispatch's ragged transport (GPU's and TPU's; XLA:CPU runs its emulation) through the config.
    ("deepseek_v3", "fsdp=2,expert=4", parallel.BATCH_AXES, {"moe_transport": "ragged"}),
    # Tokens shared by the expert group; the capacity kernel (the default on CPU is the tile loop).
    ("deepseek_v3", "data=2,expert=4", ("data", "fsdp"), {"expert_impl": "capacity"}),
    # TPU's kernel (ragged_dot) against the single-device tiled one: both dropless, equal.
    ("deepseek_v3", "expert=4,tensor=2", parallel.BATCH_AXES, {"expert_impl": "ragged_dot"}),
    ("qwen3", "data=2,fsdp=2,tensor=2", parallel.BATCH_AXES, {}),
    # The Switch balance loss is a product of means: it equals one device's only from global counts.
    ("qwen3_moe", "fsdp=2,expert=4", parallel.BATCH_AXES, {}),
    ("qwen3_moe", "data=2,expert=2,tensor=2", ("data", "fsdp"), {"placement": "save_matmuls"}),
    # Context parallelism: the sequence split over devices, keys and values gathered; both
    # attention paths (blockwise: each half of the local queries at its offset).
    ("llama", "context=2,fsdp=2,tensor=2", parallel.BATCH_AXES, {"attention": "blockwise"}),
    ("llama", "context=4,data=2", parallel.BATCH_AXES, {"attention": "xla", "placement": "save_matmuls"}),
    ("deepseek_v3", "context=2,expert=4", parallel.BATCH_AXES, {"attention": "blockwise"}),  # MTP, balance loss
    ("qwen3", "context=2,data=2,tensor=2", parallel.BATCH_AXES, {"attention": "xla"}),
    ("qwen3_moe", "context=2,fsdp=2,expert=2", parallel.BATCH_AXES, {"attention": "blockwise"}),
    # TPU's splash attention kernel (Pallas, interpreted on CPU) inside shard_map, on each
    # device's query and key/value heads. (JAX cannot interpret the GPU kernel under shard_map;
    # test_gpu_kernel_lowers_for_cuda_inside_shard_map below lowers it for CUDA there.)
    ("llama", "data=4,tensor=2", parallel.BATCH_AXES, {"attention": "splash"}),
]


def with_attention(model, attention: str):
    """The same weights on another attention path (``config.attention``)."""
    return with_config(model, attention=attention)


def with_config(model, **fields):
    """The same weights under a config with ``fields`` replaced (settings, not architecture)."""
    from zoo.params import flatten

    extra = {"expert_impl": model.expert_impl} if hasattr(model, "expert_impl") else {}
    config = dataclasses.replace(model.config, **fields)
    return type(model)(config, arrays=flatten(model), compute_dtype=model.compute_dtype, **extra)


@pytest.mark.parametrize(
    "name, spec, batch_axes, kwargs",
    LAYOUTS,
    ids=[f"{m}-{s}-{len(b)}{'-' if k else ''}{'-'.join(map(str, k.values()))}" for m, s, b, k in LAYOUTS],
)
def test_sharded_step_equals_single_device(name, spec, batch_axes, kwargs):
    model, loss_fn, has_aux = MODELS[name]()
    kwargs = dict(kwargs)
    if "expert_impl" in kwargs:
        model = model.with_expert_impl(kwargs.pop("expert_impl"))
    if "attention" in kwargs:
        model = with_attention(model, kwargs.pop("attention"))
    if "moe_transport" in kwargs:
        model = with_config(model, moe_transport=kwargs.pop("moe_transport"))
    layout = LAYOUT[name]
    mesh = parallel.make_mesh(spec)
    sharded = parallel.shard(model, mesh)

    # Parameter bytes per device shrink by exactly the product of the axes each one is split on.
    full = {p: x.nbytes for p, x in flat(model).items()}
    expected = sum(n // split_by(layout[p], mesh) for p, n in full.items())
    assert parallel.param_bytes(sharded) == expected
    print(f"\n{name} {spec}: {parallel.param_bytes(sharded)} parameter bytes per device of {sum(full.values())}")

    step = parallel.value_and_grad(functools.partial(loss_fn, **kwargs), mesh, has_aux=has_aux, batch_axes=batch_axes)
    value, grads = step(sharded, batch(model))
    ref_value, ref_grads = reference(name)
    loss, ref_loss = (value[0], ref_value[0]) if has_aux else (value, ref_value)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    g, ref_g, params = flat(grads), flat(ref_grads), flat(sharded)
    assert set(g) == set(ref_g)
    for path in g:
        r = np.asarray(ref_g[path])
        np.testing.assert_allclose(np.asarray(g[path]), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=path)
        # Gradients come back laid out like the parameters, ready for the optimizer.
        assert g[path].sharding.is_equivalent_to(params[path].sharding, g[path].ndim), path
    if has_aux:
        aux, ref_aux = value[1], ref_value[1]
        aux, ref_aux = (a._asdict() if hasattr(a, "_asdict") else a for a in (aux, ref_aux))
        assert set(aux) == set(ref_aux) and "lm_loss" in aux
        for field in aux:
            got, want = np.asarray(aux[field]), np.asarray(ref_aux[field])
            if np.issubdtype(want.dtype, np.integer):  # counts are summed over the batch shards, not averaged
                np.testing.assert_array_equal(got, want, err_msg=field)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=field)
    if "moe_layers.moe.router_bias" in g:
        assert not np.any(np.asarray(g["moe_layers.moe.router_bias"]))  # trainable=False: no update


@pytest.mark.parametrize("spec, batch_axes", [
    ("fsdp=2,expert=4", parallel.BATCH_AXES),  # tokens split over the expert group: it splits the batch like fsdp
    ("data=2,expert=4", ("data", "fsdp")),  # tokens shared by the group: stored split, gathered, same gradient
])  # fmt: skip
def test_weights_outside_the_experts_are_split_over_the_expert_group_too(spec, batch_axes):
    """DeepSeek-V3 (issue 38): every parameter but a routed expert's (attention, the dense
    layers, shared experts, router, norms, embedding and head) holds 1/(fsdp x expert) of its
    bytes per device (the expert group joins fsdp on it), where it held 1/fsdp; the routed
    experts keep 1/(expert x fsdp) over their own dimensions. The step still equals one
    device's, its gradients laid out like the parameters."""
    model, mesh = deepseek(), parallel.make_mesh(spec)
    group = mesh.shape["fsdp"] * mesh.shape["expert"]
    sharded = parallel.shard(model, mesh)
    for path, x in flat(sharded).items():
        if path.endswith("router_bias"):  # [E], a buffer nothing splits
            continue
        assert x.addressable_shards[0].data.nbytes * group == x.nbytes, (path, x.sharding.spec)
        if path.split(".")[-1] in ("w_gate", "w_up", "w_down") and ".moe." in f".{path}" and "shared" not in path:
            assert "expert" in tuple(x.sharding.spec), path  # a routed expert's: E over the group, D over fsdp
        elif path not in ("embed", "head"):  # the vocabulary takes fsdp, the expert group D
            assert any("expert" in parallel.axis_names(e) and "fsdp" in parallel.axis_names(e) or
                       e == "expert" and mesh.shape["fsdp"] == 1 for e in x.sharding.spec), (path, x.sharding.spec)  # fmt: skip
    step = parallel.value_and_grad(deepseek_v3_loss, mesh, has_aux=True, batch_axes=batch_axes)
    (loss, _), grads = step(sharded, batch(model))
    (ref_loss, _), ref_grads = reference("deepseek_v3")
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    g, ref, params = flat(grads), flat(ref_grads), flat(sharded)
    for path in g:
        r = np.asarray(ref[path])
        np.testing.assert_allclose(np.asarray(g[path]), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=path)
        assert g[path].sharding.is_equivalent_to(params[path].sharding, g[path].ndim), path


def test_the_expert_group_joins_only_where_it_divides():
    """A dimension the expert group does not divide with fsdp stays split over fsdp alone, as
    before the group joined (no new MeshError); where fsdp alone does not divide it, the error
    names fsdp, as before; a model without experts still refuses an expert axis."""
    config = deepseek_preset("tiny", kv_lora_rank=12)  # C = 12: fsdp=2 divides it, fsdp=2 x expert=4 does not
    mesh = parallel.make_mesh("fsdp=2,expert=4")
    parallel.validate_mesh(mesh, config)
    specs = parallel.param_shardings(config, mesh)
    assert specs["moe_layers.attn.kv_norm"].spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert specs["moe_layers.attn.wkv_b"].spec == jax.sharding.PartitionSpec(None, "fsdp", None, None)
    assert specs["moe_layers.attn.wq_b"].spec == jax.sharding.PartitionSpec(None, ("fsdp", "expert"), None, None)
    on_expert = parallel.param_shardings(config, parallel.make_mesh("expert=8"))
    assert on_expert["moe_layers.attn.kv_norm"].spec == jax.sharding.PartitionSpec(None, None)  # whole, as before
    with pytest.raises(MeshError, match=r"kv_lora_rank = 12 is not divisible by mesh axis 'fsdp' of size 8"):
        parallel.validate_mesh(parallel.make_mesh("fsdp=8"), config)
    dense = qwen3_preset("tiny")
    with pytest.raises(MeshError, match=r"mesh axis 'expert' has size 8 but Qwen3Config has no experts"):
        parallel.validate_mesh(parallel.make_mesh("expert=8"), dense)


OFFLOAD_UNDER_EP = """
import test_parallel as t
t.test_sharded_step_equals_single_device("deepseek_v3", "data=2,expert=4", t.parallel.BATCH_AXES, {"placement": "nvidia_offload"})
print("ok")
"""


def test_host_offload_under_expert_parallelism_equals_single_device():
    """A placement map that offloads to pinned host, under expert parallelism (data=2 x
    expert=4): the sharded step equals the single-device one.

    In a fresh process with no compilation cache: jaxlib 0.10's XLA:CPU runs a multi-device
    program with host-memory buffers reliably only compiled fresh in a process of its own
    (see test_placement.test_params_and_optimizer_state_on_host_under_a_mesh); in the shared
    test process it once aborted a later multi-device test.
    """
    assert run_in_fresh_process(OFFLOAD_UNDER_EP).strip().endswith("ok")


def primitives(jaxpr) -> list[tuple[str, dict]]:
    """Every equation's primitive name and parameters, sub-programs included."""
    from zoo.placement import subjaxprs

    out = []
    for eqn in jaxpr.eqns:
        out.append((eqn.primitive.name, eqn.params))
        for sub in subjaxprs(eqn):
            out += primitives(sub)
    return out


@pytest.mark.parametrize("spec, batch_axes, dispatch", [
    ("fsdp=2,expert=4", parallel.BATCH_AXES, "all_to_all"),  # tokens split over the group (default)
    ("data=2,expert=4", ("data", "fsdp"), "psum"),  # tokens shared by the group: no move
])  # fmt: skip
def test_expert_parallelism_moves_tokens_by_all_to_all(spec, batch_axes, dispatch):
    """Tokens split over the expert group reach their experts by all-to-all, never by an
    all-gather over ``expert``; tokens the group shares are not moved at all. The weights
    outside the experts, stored split over the group too, are what it gathers: every
    all-gather over ``expert`` takes a parameter's shard (one layer's, in a layer stack)."""
    model = deepseek()
    mesh = parallel.make_mesh(spec)
    step = parallel.value_and_grad(deepseek_v3_loss, mesh, has_aux=True, batch_axes=batch_axes)
    sharded = parallel.shard(model, mesh)
    jaxpr = jax.make_jaxpr(step)(sharded, batch(model)).jaxpr
    prims = primitives(jaxpr)

    def over_expert(*names):
        axes = [p.get("axis_name", p.get("axes", ())) for n, p in prims if n in names]
        return [a for a in axes if "expert" in ((a,) if isinstance(a, str) else tuple(a))]

    def gathers_over_expert(j) -> list[tuple[int, ...]]:
        """The operand shape of every all-gather over ``expert`` (the shared group's are invariant)."""
        from zoo.placement import subjaxprs

        out = []
        for eqn in j.eqns:
            names = eqn.params.get("axis_name", ())
            names = (names,) if isinstance(names, str) else tuple(names)
            if eqn.primitive.name in ("all_gather", "all_gather_invariant") and "expert" in names:
                out.append(tuple(eqn.invars[0].aval.shape))
            for sub in subjaxprs(eqn):
                out += gathers_over_expert(sub)
        return out

    shards = {x.addressable_shards[0].data.shape for x in jax.tree.leaves(sharded) if isinstance(x, jax.Array)}
    shards |= {s[1:] for s in shards}  # one layer of a stack's shard
    gathered = gathers_over_expert(jaxpr)
    assert gathered and set(gathered) <= shards, set(gathered) - shards  # weights only: no tokens
    if dispatch == "all_to_all":
        # Two traced MoE bodies (the scanned MoE layers, the MTP block), each with a first round
        # of 3 forward (tokens, their expert ids, the outputs back) and 2 backward (the float
        # ones' transposes), and the loop of later rounds (zoo.layers.moe_dispatch): 3 forward,
        # and in its backward the 3 recomputed and 2 transposes.
        assert len(over_expert("all_to_all")) == 2 * ((3 + 2) + (3 + 3 + 2))
    else:
        assert not over_expert("all_to_all")


PACKED = [
    ("llama", "data=2,fsdp=2,tensor=2", None),
    ("llama", "context=2,data=2,tensor=2", "blockwise"),
    ("deepseek_v3", "context=2,expert=4", "xla"),
    ("qwen3", "context=4,fsdp=2", "blockwise"),
    ("qwen3_moe", "context=2,expert=2,fsdp=2", "xla"),
    # A Pallas kernel (TPU's splash, interpreted) on packed rows inside the scanned, rematted step.
    ("llama", "data=4,tensor=2", "splash"),
]


@pytest.mark.parametrize("name, spec, attention", PACKED, ids=[f"{n}-{s}-{a}" for n, s, a in PACKED])
def test_array_keyword_arguments_are_split_like_the_batch(name, spec, attention):
    """``segment_ids=`` / ``positions=`` / ``loss_mask=`` (keyword-only in the losses) reach
    every device's own rows (and, under context parallelism, its own chunks of them). Each row
    packs two documents at its own boundary, then padding, and masks some targets, so every
    shard counts a different number of predictions: the loss is still the mean over all of
    them (not the mean of the shards' means), and the gradients equal one device's."""
    model, loss_fn, has_aux = MODELS[name]()
    if attention is not None:
        model = with_attention(model, attention)
    ids = batch(model)
    rows, s = ids.shape
    t = jnp.arange(s)
    cut, pad = 3 + jnp.arange(rows)[:, None] % 5, 16 - jnp.arange(rows)[:, None] % 4
    segment_ids = jnp.where(t < cut, 1, jnp.where(t < pad, 2, 0)).astype(jnp.int32)
    positions = jnp.where(t < cut, t, t - cut).astype(jnp.int32)
    loss_mask = (t + jnp.arange(rows)[:, None]) % 7 != 0
    kw = {"segment_ids": segment_ids, "positions": positions, "loss_mask": loss_mask}
    ref_value, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=has_aux))(model, ids, **kw)
    mesh = parallel.make_mesh(spec)
    value, grads = parallel.value_and_grad(loss_fn, mesh, has_aux=has_aux)(parallel.shard(model, mesh), ids, **kw)
    loss, ref_loss = (value[0], ref_value[0]) if has_aux else (value, ref_value)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    plain = reference(name)[0]
    assert abs(float(ref_loss) - float(plain[0] if has_aux else plain)) > 1e-3  # the masks changed the loss
    for path, g in flat(grads).items():
        r = np.asarray(flat(ref_grads)[path])
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=path)
    if has_aux:  # the metrics too: expert loads summed, balance losses over whole sequences
        aux, ref_aux = (a._asdict() if hasattr(a, "_asdict") else a for a in (value[1], ref_value[1]))
        for field, got in aux.items():
            if got is not None:
                np.testing.assert_allclose(np.asarray(got), np.asarray(ref_aux[field]), rtol=1e-5, err_msg=field)
    with pytest.raises(MeshError, match=r"keyword argument segment_ids=: leading size 5 is not divisible by"):
        parallel.value_and_grad(loss_fn, mesh)(model, ids, segment_ids=segment_ids[:5])


def test_fsdp_holds_one_layer_of_full_weights():
    """The compiled step's temporaries stay under half the layer stack's full weights: the
    backward pass re-gathers each layer instead of keeping every gathered layer."""
    config = zoo.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_layers=8,
                             num_heads=4, num_kv_heads=4, head_dim=64)  # fmt: skip
    model = zoo.Llama(config, key=jax.random.key(0))
    mesh = parallel.make_mesh("fsdp=8")
    sharded = parallel.shard(model, mesh)
    stack = sum(x.nbytes for x in jax.tree.leaves(model.layers))
    assert parallel.param_bytes(sharded.layers) == stack // 8
    step = parallel.value_and_grad(zoo.lm_loss, mesh)
    temp = jax.jit(step).lower(sharded, jnp.zeros((8, 8), jnp.int32)).compile().memory_analysis().temp_size_in_bytes
    print(f"\nfsdp=8 step temporaries: {temp / 2**20:.1f} MiB; full layer stack {stack / 2**20:.1f} MiB")
    assert temp < stack / 2


def test_step_errors_name_the_culprit():
    model, mesh = llama(), parallel.make_mesh("data=2,fsdp=4")
    step = parallel.value_and_grad(zoo.lm_loss, mesh)
    with pytest.raises(MeshError, match=r"batch argument 0: leading size 6 is not divisible by data=2 x fsdp=4 = 8"):
        step(model, jnp.zeros((6, 4), jnp.int32))
    with pytest.raises(MeshError, match=r"'tensor' cannot split the batch"):
        parallel.value_and_grad(zoo.lm_loss, mesh, batch_axes=("data", "tensor"))
    context = parallel.value_and_grad(zoo.lm_loss, parallel.make_mesh("context=2,data=4"))
    with pytest.raises(MeshError, match=r"batch argument 0: context=2 splits the sequence \(axis 1\) into 4 equal chunks; got shape \(8, 6\)"):
        context(model, jnp.zeros((8, 6), jnp.int32))
    with pytest.raises(MeshError, match=r"unknown mesh axis 'contxt' \(did you mean 'context'\?\); axes: pipeline, data, fsdp, context, tensor, expert"):
        parallel.make_mesh("contxt=2,data=4")


# -- multi-host ---------------------------------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    import jax
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    from zoo import parallel
    ran = parallel.initialize_distributed()
    import jax.numpy as jnp, numpy as np
    import zoo
    from jax.sharding import NamedSharding, PartitionSpec as P
    from zoo.llama import preset

    assert ran == (jax.process_count() > 1) and len(jax.devices()) == 4, (ran, jax.devices())
    model = zoo.Llama(preset("tiny"), key=jax.random.key(0))
    mesh = parallel.make_mesh("fsdp=2,tensor=2")
    ids = np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 256, dtype=jnp.int32))
    ids = jax.make_array_from_callback(ids.shape, NamedSharding(mesh, P(("data", "fsdp"))), lambda i: ids[i])
    loss, grads = parallel.value_and_grad(zoo.lm_loss, mesh)(parallel.shard(model, mesh), ids)
    norm = jax.jit(lambda g: jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))),
                   out_shardings=NamedSharding(mesh, P()))(grads)
    value = lambda x: repr(float(np.asarray(x.addressable_data(0))))
    print("RESULT", jax.process_index(), value(loss), value(norm), flush=True)
    """
)


def _run_workers(n: int, devices: int) -> list[tuple[float, float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if n > 1:
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": str(n)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(devices)], env=env | ({"JAX_PROCESS_ID": str(i)} if n > 1 else {}),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(n)
    ]  # fmt: skip
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("RESULT"))
        results.append(tuple(float(v) for v in line.split()[2:]))
    return results


def test_two_processes_match_one():
    """2 processes x 2 CPU devices compute the loss and gradient norm of 1 process x 4 (here)."""
    model = llama()
    mesh = parallel.make_mesh("fsdp=2,tensor=2", devices=jax.devices()[:4])
    loss, grads = parallel.value_and_grad(zoo.lm_loss, mesh)(parallel.shard(model, mesh), batch(model))
    norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))))
    results = _run_workers(2, 2)
    assert len(results) == 2
    for worker_loss, worker_norm in results:
        np.testing.assert_allclose(worker_loss, float(loss), rtol=1e-6)
        np.testing.assert_allclose(worker_norm, norm, rtol=1e-6)


def test_two_processes_train_on_a_text_file_like_one(tmp_path):
    """The training recipe on a real text file: 2 processes x 2 CPU devices (each reads and puts
    on its devices only its rows of every batch) log the losses of 1 process x 4, step for step;
    each process tokenizes half the records and process 0 merges the halves into the cache
    entry one process writes (the same bytes)."""
    text = tmp_path / "corpus.jsonl"  # records: tokenized into the cache and packed (a text file is read as bytes)
    chunks = ((ROOT / "zoo" / "train" / "loop.py").read_text() + (ROOT / "zoo" / "core" / "layout.py").read_text()
              + (ROOT / "zoo" / "parallel" / "step.py").read_text()).split("\n\n")
    text.write_text("".join(json.dumps({"text": c}) + "\n" for c in chunks))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")

    def recipe(run: str, devices: int, *extra: str) -> list[str]:
        return [sys.executable, str(ROOT / "recipes" / "train.py"), "--preset", "tiny", "--data", str(text),
                "--steps", "3", "--batch-size", "8", "--seq-len", "32", "--log-every", "1", "--eval-every", "3",
                "--mesh", "data=2,fsdp=2", "--cpu-devices", str(devices), "--run-dir", str(tmp_path / run),
                "--peak-tflops", "1", *extra]  # fmt: skip

    port = free_port()
    two = [
        subprocess.Popen(recipe("two", 2, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                                "--data-cache", str(tmp_path / "cache")),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]  # fmt: skip
    one = subprocess.run(recipe("one", 4, "--data-cache", str(tmp_path / "cache-one")), env=env, capture_output=True, text=True, timeout=600, check=False)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    outputs = []
    for p in two:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
        outputs.append(out)
    assert [("tokenized part 1 of 2" in out, "tokenized part 2 of 2" in out, out.count("merged 2 parts")) for out in outputs] \
        == [(True, False, 1), (False, True, 0)], outputs  # fmt: skip
    [entry] = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # (beside it: file-hashes.json)
    [entry_one] = [p for p in (tmp_path / "cache-one").iterdir() if p.is_dir()]
    assert entry.name == entry_one.name
    for f in entry_one.iterdir():
        if f.name != "meta.json":
            assert (entry / f.name).read_bytes() == f.read_bytes(), f.name

    def losses(run: str) -> list[tuple[int, float]]:
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in records if "loss" in r]

    one, two = losses("one"), losses("two")
    assert [s for s, _ in one] == [s for s, _ in two] == [1, 2, 3]  # one metrics file, written once
    np.testing.assert_allclose([x for _, x in two], [x for _, x in one], rtol=1e-5)


def test_a_tied_embedding_gradient_is_all_reduced_once_under_context_parallelism():
    """The tied embedding's two uses (the lookup and the head) each produced a [V, D] gradient
    that was all-reduced over the context and data axes on its own: two buffers of the
    embedding's size. Every parameter is now made varying once, so its summed gradient is
    reduced once."""
    cfg = dataclasses.replace(qwen3_preset("tiny", "qwen3"), vocab_size=4096)
    assert cfg.tie_word_embeddings
    model = zoo.Qwen3(cfg, key=jax.random.key(0))
    mesh = parallel.make_mesh("context=4,data=2")
    ids = jax.random.randint(jax.random.key(1), (8, 64), 0, cfg.vocab_size, dtype=jnp.int32)
    step = parallel.value_and_grad(zoo.lm_loss, mesh)
    sharded = parallel.shard(model, mesh)
    hlo = jax.jit(step).lower(sharded, ids).compile().as_text()
    embedding = f"f32[{cfg.vocab_size},{cfg.hidden_size}]"
    results = [line.split("=", 1)[1].split(" all-reduce")[0] for line in hlo.splitlines()
               if re.search(r" all-reduce(-start)?\(", line)]  # fmt: skip
    assert sum(r.count(embedding) for r in results) == 1, results
    loss, grads = step(sharded, ids)
    ref_loss, ref_grads = eqx.filter_value_and_grad(zoo.lm_loss)(model, ids)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):  # the file's parity tolerance
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))


def test_gpu_kernel_lowers_for_cuda_inside_shard_map():
    """No GPU here, and JAX cannot interpret the Triton kernel inside shard_map: lower the
    sharded gradient for CUDA instead, on an abstract mesh of abstract H100s (newer JAX reads
    the GPU it compiles Triton for from the mesh). Every kernel (forward, backward's
    preprocessing and its fused dk/dv/dq) is a Triton call, and nothing else computes attention."""
    from zoo.layers import pallas_attention

    if not pallas_attention.gpu_kernel_available():  # JAX 0.12.1 on: tests/test_attention.py checks the refusal
        with pytest.raises(ValueError, match="no longer ships"):
            pallas_attention.require_gpu_kernel()
        return
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"), abstract_device=gpu)
    spec = jax.P("data", None, "tensor")

    def loss(q, k, v, seg):
        out = pallas_attention.pallas_gpu_attention(q, k, v, scale=0.1, segment_ids=seg, interpret=False)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32) ** 2), ("data", "tensor"))

    grads = jax.shard_map(
        jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh, in_specs=(spec, spec, spec, jax.P("data")), out_specs=(spec,) * 3
    )
    named = lambda *p: jax.sharding.NamedSharding(mesh, jax.P(*p))  # noqa: E731
    args = [jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16, sharding=named(*spec))]
    args += [jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16, sharding=named(*spec))] * 2
    args += [jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=named("data"))]
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    names = sorted(set(re.findall(r'name = "(mha_\w+)"', text)))
    assert names == ["mha_backward", "mha_forward", "mha_preprocess_backward"], names
    assert "stablehlo.dot_general" not in text  # no dense attention anywhere in the program


# -- expert parallelism on adversarial routing ------------------------------------------------


def all_to_first_experts(model, **dispatch):
    """The same model with every router (and DeepSeek-V3's bias) zero: every score ties, so every
    token picks experts 0..K-1, all on the expert group's first device; ``dispatch`` sets the
    config's ``capacity_factor`` / ``moe_overflow``."""
    from zoo.params import flatten

    arrays = {p: (jnp.zeros_like(x) if p.split(".")[-1] in ("router", "router_bias") else x)
              for p, x in flatten(model).items()}  # fmt: skip
    config = dataclasses.replace(model.config, **dispatch)
    return type(model)(config, arrays=arrays, compute_dtype=model.compute_dtype, expert_impl=model.expert_impl)


def moe_bodies(model) -> int:
    """MoE layers the forward pass runs (DeepSeek-V3's MTP block included)."""
    config = model.config
    if isinstance(model, zoo.DeepseekV3):
        return config.num_layers - config.first_k_dense_replace + int(config.mtp)
    return config.layer_kinds.count("moe")


@pytest.mark.parametrize("name, spec", [("deepseek_v3", "fsdp=2,expert=4"), ("qwen3_moe", "fsdp=2,expert=4"),
                                        ("qwen3_moe", "expert=4,tensor=2")])  # fmt: skip
def test_every_token_to_one_device_equals_single_device(name, spec):
    """All tokens routed to the experts of one device, at capacity factor 1: the dropless
    dispatch runs four rounds of slots and the step equals one device's (loss, metrics and
    gradients); with token dropping the step counts exactly the pairs past the slots."""
    model, loss_fn, has_aux = MODELS[name]()
    model = all_to_first_experts(model, capacity_factor=1.0)
    mesh = parallel.make_mesh(spec)
    ids = batch(model)
    (ref_loss, ref_aux), ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=True))(model, ids)
    load = ref_aux["expert_load"] if isinstance(ref_aux, dict) else ref_aux.expert_load
    assert np.asarray(load)[..., model.config.num_experts_per_tok :].sum() == 0  # every pair to experts 0..K-1
    step = parallel.value_and_grad(loss_fn, mesh, has_aux=True)
    (loss, _), grads = step(parallel.shard(model, mesh), ids)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    g, ref_g = flat(grads), flat(ref_grads)
    for path in ref_g:
        r = np.asarray(ref_g[path])
        np.testing.assert_allclose(np.asarray(g[path]), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=path)

    dropping = all_to_first_experts(model, capacity_factor=1.0, moe_overflow="drop")
    (drop_loss, metrics), _ = parallel.value_and_grad(training_loss, mesh, has_aux=True)(parallel.shard(dropping, mesh), ids)
    devices = mesh.size // mesh.shape["tensor"]  # the batch's shards
    pairs = ids.size // devices * model.config.num_experts_per_tok  # a device's pairs, all to one destination
    expected = moe_bodies(model) * devices * (pairs - slot_rows(pairs, mesh.shape["expert"], 1.0))
    assert int(metrics["moe_dropped_pairs"]) == expected > 0
    assert float(drop_loss) != float(ref_loss)


@pytest.mark.parametrize("name, spec, routing", [("deepseek_v3", "fsdp=4,tensor=2", "balanced"),
                                                 ("deepseek_v3", "fsdp=8", "adversarial"),
                                                 ("qwen3_moe", "data=2,fsdp=4", "adversarial")])  # fmt: skip
def test_experts_gathered_a_block_at_a_time_equal_single_device(name, spec, routing, monkeypatch):
    """Where no mesh axis splits the experts, the step gathers a layer's routed experts over
    FSDP a block of experts at a time (``zoo.layers.moe.EXPERT_BLOCK_BYTES``, here a quarter
    of a layer's: four blocks): loss, metrics and gradients equal one device's, with every
    token routed to the first experts (one block overflows, the others get nothing) too."""
    from zoo.layers import moe

    model, loss_fn, _ = MODELS[name]()
    if routing == "adversarial":
        model = all_to_first_experts(model, capacity_factor=1.0)
    w = model.moe_layers.moe.w_gate
    mesh = parallel.make_mesh(spec)
    experts, d, m = w.shape[1:]  # a device gathers its "tensor" block of the hidden units M
    monkeypatch.setattr(moe, "EXPERT_BLOCK_BYTES", 3 * experts * d * m // mesh.shape["tensor"] * w.dtype.itemsize // 4)
    blocks = []
    monkeypatch.setattr(moe, "expert_blocks", lambda *a, f=moe.expert_blocks: blocks.append(f(*a)) or blocks[-1])
    ids = batch(model)
    (ref_loss, ref_aux), ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn, has_aux=True))(model, ids)
    (loss, aux), grads = parallel.value_and_grad(loss_fn, mesh, has_aux=True)(parallel.shard(model, mesh), ids)
    assert blocks and set(blocks) == {4}
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    aux, ref_aux = (a._asdict() if hasattr(a, "_asdict") else a for a in (aux, ref_aux))
    for field in ref_aux:
        np.testing.assert_allclose(np.asarray(aux[field]), np.asarray(ref_aux[field]), rtol=1e-5, err_msg=field)
    g, ref_g = flat(grads), flat(ref_grads)
    for path in ref_g:
        r = np.asarray(ref_g[path])
        np.testing.assert_allclose(np.asarray(g[path]), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=path)


def test_a_block_of_experts_is_gathered_twice_a_step(monkeypatch):
    """Under full remat, each block of a layer's routed experts is all-gathered twice a step:
    once going forward and once going backward (which recomputes the block). Combined inside the
    block, the blocks' rows are not needed after the loop, so the layer's recomputed forward pass
    leaves the loop out: it had gathered every block a third time. The MTP block's experts are
    gathered as a layer's (they were gathered whole at the step's start, held all step)."""
    from zoo.layers import moe

    model = zoo.DeepseekV3(deepseek_preset("tiny", mtp=True), key=jax.random.key(0))
    experts, d, m = model.moe_layers.moe.w_gate.shape[1:]
    monkeypatch.setattr(moe, "EXPERT_BLOCK_BYTES", 3 * experts * d * m * 4 // 4)  # four blocks
    mesh = parallel.make_mesh("fsdp=8")
    step = parallel.value_and_grad(functools.partial(deepseek_v3_loss, placement="remat"), mesh, has_aux=True)
    hlo = jax.jit(step).lower(parallel.shard(model, mesh), batch(model)).compile().as_text()
    gathers = {g: re.compile(rf"= f32\[({g},{d},{m}|{g},{m},{d})\]\{{[0-9,]+\}} all-gather\(") for g in (experts, experts // 4)}
    assert len(gathers[experts].findall(hlo)) == 0  # no layer's experts whole
    assert len(gathers[experts // 4].findall(hlo)) == 2 * 3 * 2  # w_gate, w_up, w_down: forward and backward, stack and MTP
