"""No process holds the whole model: checkpoints loaded onto a mesh shard by shard, fresh
models and optimizer state made in place, sharded models saved tensor by tensor; on one
process x 8 CPU devices and on 2 processes x 2 (the few-GB memory figures are
benchmarks/sharded_io.py's)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import free_port, run_in_fresh_process, supported_compile_options
from jax.sharding import NamedSharding, PartitionSpec

import zoo
from zoo import parallel, train
from zoo.hf.safetensors import CheckpointFiles
from zoo.params import flatten

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
# (fixture, mesh, from_pretrained options): every family, FP8 blocks cut by the shards
# (32x32 tiles, 16-wide shards), experts split over the expert axis, tensor and FSDP axes.
CASES = [
    ("llama3_1-tiny", "fsdp=4,tensor=2", {}),
    ("llama3_1-tiny-tied-mqa", "fsdp=8", {}),
    ("deepseek_v3-tiny-fp8", "fsdp=4,expert=2", {}),
    ("deepseek_v3-tiny-16e-mtp", "tensor=2,expert=4", {"mtp": True}),
    ("qwen3_moe-tiny", "expert=4,fsdp=2", {}),
    ("qwen3_moe-tiny-mixed-sharded", "fsdp=2,tensor=2,expert=2", {}),
    ("qwen3-tiny-tied", "data=2,fsdp=4", {}),
]


def _check_layout(arrays: dict, mesh, config) -> None:
    shardings = parallel.param_shardings(config, mesh)
    assert arrays.keys() <= shardings.keys()
    for path, x in arrays.items():
        assert x.sharding.is_equivalent_to(shardings[path], x.ndim), (path, x.sharding.spec, shardings[path].spec)


@pytest.mark.parametrize("fixture, spec, options", CASES, ids=[c[0] + ":" + c[1] for c in CASES])
def test_from_pretrained_onto_a_mesh_equals_the_whole_load(fixture, spec, options):
    mesh = parallel.make_mesh(spec)
    whole = flatten(zoo.from_pretrained(FIXTURES / fixture, **options))
    model = zoo.from_pretrained(FIXTURES / fixture, mesh=mesh, **options)
    sharded = flatten(model)
    assert sharded.keys() == whole.keys()
    _check_layout(sharded, mesh, model.config)
    for path in whole:
        assert sharded[path].dtype == whole[path].dtype
        np.testing.assert_array_equal(np.asarray(sharded[path]), np.asarray(whole[path]), err_msg=path)


def test_each_device_reads_only_its_experts(monkeypatch):
    """Under expert parallelism a device's shard needs only its experts' stored tensors: the
    loader reads each expert tensor once, for the devices that hold it."""
    from zoo.hf import load

    reads: list[str] = []
    region = load._TensorSource.region
    monkeypatch.setattr(load._TensorSource, "region", lambda self, key, idx: reads.append(key) or region(self, key, idx))
    zoo.from_pretrained(FIXTURES / "qwen3_moe-tiny", mesh=parallel.make_mesh("expert=8"))
    experts = [k for k in reads if ".experts." in k]
    assert experts and len(experts) == len(set(experts))  # each once: 8 devices, one expert each


FRESH = [("llama", "fsdp=4,tensor=2"), ("deepseek_v3", "fsdp=2,expert=4"), ("qwen3_moe", "expert=4,fsdp=2")]


@pytest.mark.parametrize("family, spec", FRESH)
def test_a_fresh_model_is_made_in_place(family, spec):
    cls = zoo.core.registry.by_model_type(family)
    config = cls.config_cls.preset("tiny", family)
    mesh = parallel.make_mesh(spec)
    _check_layout(flatten(cls(config, key=jax.random.key(3), mesh=mesh)), mesh, config)


# Meshes that pad what they split: layer stacks the stages do not divide (2 Llama layers on 4
# stages, DeepSeek-V3 small's one dense layer and Qwen3-MoE small's stacks on 2) and an MLP width
# the tensor axis does not divide (161 hidden units on tensor=2).
PADDED = [("llama", "tiny", "pipeline=4,fsdp=2", {}), ("llama", "tiny", "tensor=2,fsdp=4", {"intermediate_size": 161}),
          ("deepseek_v3", "small", "pipeline=2,fsdp=4", {}), ("qwen3_moe", "small", "pipeline=2,expert=4", {})]  # fmt: skip


@pytest.mark.parametrize("family, preset, spec, change", PADDED, ids=[f"{f}-{s}" for f, _, s, _ in PADDED])
def test_a_fresh_model_made_in_place_is_padded_as_a_placed_one(family, preset, spec, change):
    """Made on a mesh that pads, a fresh model has the layout a model made whole and placed with
    zoo.parallel.shard has: the same shapes, the same values (within the suite's -O0 rounding of
    a draw, 1 ulp) and zeros in the padding (it raised IndivisibleError or a scan TypeError)."""
    cls = zoo.core.registry.by_model_type(family)
    config = dataclasses.replace(cls.config_cls.preset(preset, family), **change)
    mesh = parallel.make_mesh(spec)
    assert parallel.is_padded(config, mesh)
    made = flatten(cls(config, key=jax.random.key(3), mesh=mesh))
    placed = flatten(parallel.pad(cls(config, key=jax.random.key(3)), mesh))
    _check_layout(made, mesh, config)
    assert made.keys() == placed.keys()
    for path, x in made.items():
        want = np.asarray(placed[path])
        assert x.shape == want.shape, path
        np.testing.assert_allclose(np.asarray(x), want, rtol=1e-6, atol=0, err_msg=path)
        assert np.array_equal(np.asarray(x) == 0, want == 0), path  # the padding: exact zeros, nowhere else


def test_a_fresh_model_made_in_place_has_the_unsharded_values():
    """Bit for bit, under XLA's own settings: the suite's compile-time flags (-O0 with the
    classic emitters, conftest.py) round 1 in 30 normal draws of a shard 1 ulp apart."""
    out = run_in_fresh_process(
        f"""
import jax, numpy as np, zoo
from zoo import parallel
from zoo.core import registry
from zoo.params import flatten
for family, spec in {FRESH!r}:
    cls = registry.by_model_type(family)
    config = cls.config_cls.preset("tiny", family)
    whole = flatten(cls(config, key=jax.random.key(3)))
    sharded = flatten(cls(config, key=jax.random.key(3), mesh=parallel.make_mesh(spec)))
    for path in whole:
        assert np.array_equal(np.asarray(sharded[path]), np.asarray(whole[path])), (family, path)
    print("equal", family, len(whole))
""",
        xla_defaults=True,
    )
    assert out.split() == [w for f, _ in FRESH for w in ("equal", f, str(_count(f)))]


def _count(family: str) -> int:
    cls = zoo.core.registry.by_model_type(family)
    return len(jax.eval_shape(lambda: flatten(cls(cls.config_cls.preset("tiny", family), key=jax.random.key(0)))))


# XLA's own settings for one compile, over the suite's compile-time flags (conftest.py), which
# fuse nothing and so keep every elementwise step of a random draw as a temporary.
XLA_DEFAULTS = supported_compile_options({"xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": True})


def test_fresh_init_never_makes_a_whole_parameter_on_a_device():
    """Llama 3.2 1B made in place on fsdp=8, program by program as zoo.Llama(mesh=) runs them
    (one per parameter shape and layout): each device's output is its 1/8 share and its
    temporaries a few draw blocks (4 MB each), whatever the parameter's size; one program for
    the whole model held 7 GB of temporaries on every device, and one jax.random.normal per
    parameter 3x the device's share (threefry's counters and bits for all of it)."""
    from zoo.core import params
    from zoo.llama import preset
    from zoo.llama.model import llama_params

    config = preset("llama3.2-1b")
    mesh = parallel.make_mesh("fsdp=8")
    shardings = parallel.param_shardings(config, mesh)
    block = params.DRAW_BLOCK * 4
    seen, largest = set(), 0
    for path, p in llama_params(config).items():
        stacked = path.startswith("layers.")
        shape = p.shape(config.sizes)[1:] if stacked else p.shape(config.sizes)
        length = config.num_layers if stacked else None
        for sharding in (shardings[path], None):
            maker = params._maker(shape, p.init, 0.02, np.dtype(np.float32), "threefry2x32", length, sharding)
            if maker in seen:
                continue
            seen.add(maker)
            data = jax.ShapeDtypeStruct((2,) if length is None else (length, 2), np.uint32)
            memory = maker.lower(data).compile(XLA_DEFAULTS).memory_analysis()
            whole = np.prod(p.shape(config.sizes)) * 4
            assert memory.output_size_in_bytes <= whole / (1 if sharding is None else 8) + 64, path
            assert memory.temp_size_in_bytes <= 4 * block + 2**20, (path, memory.temp_size_in_bytes / block)
            largest = max(largest, whole)
    assert len(seen) >= 10 and largest > 60 * block  # the draws are far larger than their temporaries


@pytest.mark.parametrize("spec", ["fsdp=8", "fsdp=2,tensor=4", "expert=4,fsdp=2"])
def test_a_draw_made_block_by_block_is_jax_random_normal(spec, monkeypatch):
    """Each device draws its share slab by slab (slabs of 48 elements here), yet every
    parameter is exactly ``jax.random.normal(its key, its shape)``: the reference is JAX's own
    sampler, so the values depend on neither the mesh, the slab size nor the device count.
    (A unit std: XLA may fold ``std * sqrt(2)`` into one constant in one program and not in
    another, 1 ulp apart; the same std in both of zoo's paths is the test above.)"""
    from jax.sharding import NamedSharding

    from zoo.core import params

    monkeypatch.setattr(params, "DRAW_BLOCK", 48)
    params._maker.cache_clear()
    mesh, P = parallel.make_mesh(spec), PartitionSpec
    keys = jax.random.split(jax.random.key(7), 6)
    cases = [((6, 40, 24), P(None, "fsdp", "tensor")), ((6, 8, 40), P(None, "expert", ("fsdp", "tensor"))),
             ((40, 24), P(("tensor", "fsdp"), None)), ((6, 13, 3), P())]  # fmt: skip
    for shape, pspec in cases:
        stacked = len(shape) == 3
        want = (jax.vmap(lambda k: jax.random.normal(k, shape[1:]))(keys) if stacked
                else jax.random.normal(keys[0], shape))  # fmt: skip
        data = np.asarray(jax.random.key_data(keys if stacked else keys[0]))
        for sharding in (NamedSharding(mesh, pspec), None):
            maker = params._maker(shape[1:] if stacked else shape, "normal", 1.0, np.dtype(np.float32),
                                  "threefry2x32", 6 if stacked else None, sharding)  # fmt: skip
            got = maker(data)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{shape} {pspec} {sharding}")
            if sharding is not None:
                assert got.sharding.is_equivalent_to(sharding, len(shape))
    params._maker.cache_clear()


def test_optimizer_state_is_made_sharded_like_the_parameters():
    model = zoo.from_pretrained(FIXTURES / "llama3_1-tiny", mesh=parallel.make_mesh("fsdp=4,tensor=2"))
    mesh = parallel.make_mesh("fsdp=4,tensor=2")
    tx = train.optimizer(train.TrainConfig(steps=2, warmup=0), model)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = parallel.init_optimizer(tx, params, mesh)
    specs = jax.tree.leaves(parallel.partition_specs(state, mesh), is_leaf=lambda x: isinstance(x, PartitionSpec))
    leaves = jax.tree.leaves(state)
    assert sum(bool(any(s)) for s in specs) == 2 * len(jax.tree.leaves(params))  # mu and nu split, counts not
    for leaf, spec in zip(leaves, specs, strict=True):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)
    unsharded = tx.init(jax.tree.map(np.asarray, params))
    for a, b in zip(leaves, jax.tree.leaves(unsharded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("fixture, spec, options, memory_kind",
                         [("llama3_1-tiny", "fsdp=4,tensor=2", {}, None),
                          ("deepseek_v3-tiny-16e-mtp", "tensor=2,expert=4", {"mtp": True}, None),
                          ("qwen3_moe-tiny-mixed-sharded", "expert=4,fsdp=2", {}, "pinned_host")])  # fmt: skip
def test_a_sharded_save_writes_the_unsharded_files(fixture, spec, options, memory_kind, tmp_path):
    mesh = parallel.make_mesh(spec)
    model = zoo.from_pretrained(FIXTURES / fixture, **options)
    zoo.save_pretrained(model, tmp_path / "whole", max_shard_bytes=60_000)
    sharded = zoo.from_pretrained(FIXTURES / fixture, mesh=mesh, memory_kind=memory_kind, **options)
    if memory_kind:
        assert {x.sharding.memory_kind for x in flatten(sharded).values()} == {memory_kind}
    zoo.save_pretrained(sharded, tmp_path / "sharded", max_shard_bytes=60_000)
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "sharded").iterdir()) and len(names) > 3
    for name in names:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "sharded" / name).read_bytes(), name


def test_a_mesh_that_does_not_divide_a_tensor_is_refused_by_name():
    with pytest.raises(zoo.MeshError, match=r"LlamaConfig.num_kv_heads = 2 is not divisible by mesh axis 'tensor' of size 4"):
        zoo.from_pretrained(FIXTURES / "llama3_1-tiny", mesh=parallel.make_mesh("tensor=4,fsdp=2"))
    with pytest.raises(TypeError, match="memory_kind= goes with mesh="):
        zoo.from_pretrained(FIXTURES / "llama3_1-tiny", memory_kind="pinned_host")


def test_a_missing_or_truncated_shard_file_is_named(tmp_path):
    src = FIXTURES / "qwen3_moe-tiny-mixed-sharded"
    mesh = parallel.make_mesh("expert=4,fsdp=2")
    shutil.copytree(src, tmp_path / "missing")
    victim = sorted((tmp_path / "missing").glob("model-*.safetensors"))[3]
    victim.unlink()
    with pytest.raises(zoo.CheckpointError, match=f"names shard '{victim.name}', which is not in"):
        zoo.from_pretrained(tmp_path / "missing", mesh=mesh)
    shutil.copytree(src, tmp_path / "cut")
    victim = sorted((tmp_path / "cut").glob("model-*.safetensors"))[5]
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(zoo.CheckpointError, match=rf"{victim.name}: tensor .* runs past the end of the file"):
        zoo.from_pretrained(tmp_path / "cut", mesh=mesh)


# The mesh's last axis varies fastest over the devices: on 2 processes x 2 devices, fsdp=4 splits
# every tensor across the processes, expert=4 gives each process half of the experts.
# A fresh model made in place across the processes is compared bit for bit with one made whole
# where experts or tensors split across them; the DeepSeek-V3 cases (the suite's costliest) load
# and save only, compiled with the suite's fast settings (their fresh init: the first test above).
@pytest.mark.parametrize("fixture, spec, options", [("deepseek_v3-tiny-fp8", "fsdp=4", {"check_fresh": False}),
                                                    ("deepseek_v3-tiny-16e-mtp", "expert=4", {"mtp": True, "check_fresh": False}),
                                                    ("qwen3_moe-tiny-mixed-sharded", "expert=4", {}),
                                                    ("llama3_1-tiny", "fsdp=2,tensor=2", {"save_by_gathering": True})])  # fmt: skip
def test_two_processes_load_init_and_save_only_their_shards(fixture, spec, options, tmp_path):
    """2 processes x 2 CPU devices, the mesh across both: each process's shards equal the whole
    load's (an expert-parallel mesh: each reads only its experts), a fresh model (where
    checked) and the optimizer state are made in place, and the saved files hold the source's
    tensors exactly: written by each process for its own shards (the processes share the
    filesystem), or, as where they share none, by process 0 gathering them."""
    out = tmp_path / "saved"
    fresh = options.get("check_fresh", True)
    results = _two_processes("sharded_io_worker.py", str(FIXTURES / fixture), spec, "2", str(out),
                             *(f"{k}={json.dumps(v)}" for k, v in options.items()), xla_defaults=fresh)  # fmt: skip
    options.pop("check_fresh", None)
    gathering = options.pop("save_by_gathering", False)
    for r in results:
        assert r["wrong"] == [], r["wrong"]
        assert r["wrote_own_shards"] is not gathering
        assert r["error"] is None
    source, saved = CheckpointFiles(FIXTURES / fixture), CheckpointFiles(out)
    stored = {k for k in source.keys() if not k.endswith("_scale_inv")}
    experts = [{k for k in r["read"] if ".experts." in k} for r in results]
    if spec.startswith("expert"):
        assert experts[0] and experts[1] and not experts[0] & experts[1]  # each process only its experts
        assert experts[0] | experts[1] == {k for k in stored if ".experts." in k}
    else:
        assert experts[0] == experts[1] == {k for k in stored if ".experts." in k}  # each a slice of every one
    assert saved.keys() == stored
    for key in saved.keys():
        if not fixture.endswith("fp8"):  # an FP8 source is saved dequantized
            np.testing.assert_array_equal(saved.get(key), source.get(key), err_msg=key)
    whole = flatten(zoo.from_pretrained(FIXTURES / fixture, **options))
    again = flatten(zoo.from_pretrained(out, **options))
    for path in whole:
        np.testing.assert_array_equal(np.asarray(again[path]), np.asarray(whole[path]), err_msg=path)


def test_a_process_that_fails_its_part_of_a_save_fails_it_everywhere(tmp_path):
    """Process 1's writes fail (a full disk): both processes raise, process 0's naming process 1,
    and nothing is left: no checkpoint, no temporary directory (none waits forever either)."""
    out = tmp_path / "saved"
    results = _two_processes("sharded_io_worker.py", str(FIXTURES / "llama3_1-tiny"), "fsdp=4", "2", str(out),
                             "fail_writing_on=1", "check_fresh=false", xla_defaults=False)  # fmt: skip
    assert all(r["error"] for r in results)
    assert results[0]["error"] == f"CheckpointError: {out}: process 1 failed before it wrote its shards; nothing was saved"
    assert list(tmp_path.iterdir()) == []
    # Process 0 fails first: process 1 learns it at the next agreement and neither waits on the other.
    results = _two_processes("sharded_io_worker.py", str(FIXTURES / "llama3_1-tiny"), "fsdp=4", "2", str(out),
                             "fail_laying_out=true", "check_fresh=false", xla_defaults=False)  # fmt: skip
    assert results[0]["error"] == "OSError: [Errno 28] No space left on device"
    assert results[1]["error"] == f"CheckpointError: {out}: process 0 failed before it laid out the files; nothing was saved"
    assert list(tmp_path.iterdir()) == []


def _two_processes(script: str, *args: str, xla_defaults: bool = True) -> list[dict]:
    # XLA's own settings (not the suite's compile-time flags) where fresh values are compared bit for bit.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "XLA_FLAGS"))}
    if not xla_defaults and "XLA_FLAGS" in os.environ:
        env["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
    env |= {"PYTHONPATH": str(ROOT), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / script), *args], env=env | {"JAX_PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]  # fmt: skip
    results = []
    for p in procs:
        text, err = p.communicate(timeout=400)  # apart: the collectives' logging is not to run into the result line
        assert p.returncode == 0, (text + err)[-3000:]
        results.append(json.loads(next(x for x in text.splitlines() if x.startswith("RESULT "))[7:]))
    return results


def test_two_processes_restore_only_their_shards_of_a_training_checkpoint(tmp_path):
    """zoo.train's orbax checkpoints, restored onto the mesh with the target shardings: each of
    2 processes (fsdp=4 across them) reads about half the checkpoint's bytes on disk, where a
    replicated restore reads all of them; the restored shards equal the saved ones."""
    results = _two_processes("orbax_restore_worker.py", str(tmp_path / "run"), xla_defaults=False)
    for r in results:
        assert r["wrong"] == [], r["wrong"]
        assert r["read"]["sharded"] < 0.7, r["read"]
        assert r["read"]["replicated"] > 0.95, r["read"]


def test_the_recipe_fine_tunes_on_two_processes_each_holding_its_half(tmp_path):
    """recipes/train.py --checkpoint DIR --mesh fsdp=4 on 2 processes x 2 devices: each builds
    only its half of a 101 MB checkpoint (its devices' bytes, and its resident memory's growth
    while loading, as the recipe reports them), trains, and --save-hf writes the trained model
    in the checkpoint's own layout."""
    import dataclasses

    from zoo.llama import preset

    config = dataclasses.replace(preset("tiny"), vocab_size=32768, hidden_size=256, intermediate_size=1024, num_layers=8,
                                 num_heads=4, num_kv_heads=2, head_dim=64)  # fmt: skip
    zoo.save_pretrained(zoo.Llama(config, key=jax.random.key(0)), tmp_path / "base")
    size = sum(p.stat().st_size for p in (tmp_path / "base").glob("*.safetensors"))
    (tmp_path / "corpus.txt").write_text((ROOT / "zoo" / "hf" / "load.py").read_text())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_"))}
    env |= {"PYTHONPATH": str(ROOT)}
    port = free_port()
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), "--checkpoint", str(tmp_path / "base"), "--data",
           str(tmp_path / "corpus.txt"), "--data-cache", str(tmp_path / "cache"), "--mesh", "fsdp=4", "--cpu-devices", "2",
           "--steps", "2", "--batch-size", "4", "--seq-len", "32", "--run-dir", str(tmp_path / "run"), "--save-hf",
           str(tmp_path / "tuned"), "--peak-tflops", "1", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]  # fmt: skip
    procs = [subprocess.Popen([*cmd, "--process-id", str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]  # fmt: skip
    import re

    for p in procs:
        text, _ = p.communicate(timeout=600)
        assert p.returncode == 0, text[-3000:]
        m = re.search(r"model built on the mesh: (\d+) MiB in all; this process's devices hold (\d+) MiB of shards "
                      r"\(a replicated array once per device\); resident memory grew (\d+) MiB at most", text)  # fmt: skip
        assert m, text[-2000:]
        whole, mine, grew = (int(x) * 2**20 for x in m.groups())
        assert abs(whole - size) < 2**20 and abs(mine - whole / 2) <= 2**20
        assert grew < 0.8 * size, (grew / size, text[-1500:])  # its half and the reads in flight, never the whole
    tuned, base = CheckpointFiles(tmp_path / "tuned"), CheckpointFiles(tmp_path / "base")
    assert tuned.keys() == base.keys()
    assert all(tuned.shape(k) == base.shape(k) for k in base.keys())
    assert not np.array_equal(tuned.get("model.embed_tokens.weight"), base.get("model.embed_tokens.weight"))


def test_a_mesh_given_as_a_spec_string_is_named_with_the_call_that_builds_it():
    """It raised AttributeError: 'str' object has no attribute 'shape' (issue #42, point 9)."""
    with pytest.raises(TypeError, match=r"mesh= takes a jax Mesh, got str 'fsdp=8' \(build it with zoo.parallel.make_mesh\('fsdp=8'\)\)"):
        zoo.from_pretrained(FIXTURES / "llama3_1-tiny", mesh="fsdp=8")


def test_a_run_saved_before_the_expert_group_joined_fsdp_resumes_on_the_new_layout(tmp_path, monkeypatch):
    """Issue 38: training checkpoints written while DeepSeek-V3's weights outside the experts
    were split over fsdp alone (replicated over the expert group) restore onto today's layout,
    which splits them over fsdp x expert: orbax reads each array onto the target shardings. The
    resumed run continues at the saved step, its parameters laid out anew, and its losses are
    those of a run made on the new layout from the start (the same numbers, reduced in
    another order)."""
    from zoo.core.protocol import AxisRule
    from zoo.data import stdlib_corpus
    from zoo.deepseek_v3.config import DEEPSEEK_V3_AXES

    corpus = stdlib_corpus(max_bytes=2**20)
    cfg = train.TrainConfig(steps=4, batch_size=8, seq_len=32, warmup=1, lr=3e-3, log_every=1, eval_every=100,
                            checkpoint_every=2)  # fmt: skip
    mesh = parallel.make_mesh("fsdp=2,expert=4")
    model = zoo.DeepseekV3(zoo.deepseek_v3.preset("tiny"), key=jax.random.key(0))
    with monkeypatch.context() as old:  # the rules of before: fsdp alone
        for letter, field in (("D", "hidden_size"), ("Q", "q_lora_rank"), ("C", "kv_lora_rank")):
            old.setitem(DEEPSEEK_V3_AXES, letter, AxisRule("fsdp", field))
        assert parallel.param_shardings(model.config, mesh)["moe_layers.attn.wq_a"].spec == PartitionSpec(None, "fsdp", None)
        train.train(model, corpus, cfg, run_dir=tmp_path / "cut", mesh=mesh, stop_after=2)
    new = parallel.param_shardings(model.config, mesh)
    assert new["moe_layers.attn.wq_a"].spec == PartitionSpec(None, ("fsdp", "expert"), None)
    resumed, rest = train.train(model, corpus, cfg, run_dir=tmp_path / "cut", mesh=mesh, resume=True)
    assert [r["step"] for r in rest if "loss" in r] == [3, 4]
    for path, x in flatten(resumed).items():
        assert x.sharding.is_equivalent_to(new[path], x.ndim), (path, x.sharding.spec)
    _, full = train.train(model, corpus, cfg, run_dir=tmp_path / "full", mesh=mesh)
    np.testing.assert_allclose([r["loss"] for r in rest if "loss" in r], [r["loss"] for r in full if "loss" in r][2:],
                               rtol=1e-5)  # fmt: skip
