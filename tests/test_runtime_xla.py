"""The train step's XLA options per backend (zoo.runtime.step_xla_options), XLA's pinned host pool
sized before the backend starts (zoo.runtime.size_host_pool), and the recipe's flags for both."""

import importlib.util
import math
import warnings
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import zoo
from zoo import runtime
from zoo import train as ztrain
from zoo.plan import auto
from zoo.llama import preset

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def test_gpu_set_for_a_cuda_target_each_option_with_why_and_source():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the installed jaxlib knows every GPU option: nothing dropped
        cuda = runtime.step_xla_options("cuda")
    assert cuda == runtime.step_xla_options("gpu")  # a lowering platform names its backend's set
    assert cuda["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert cuda["xla_gpu_enable_host_memory_offloading"] is True
    assert cuda["xla_gpu_enable_pipelined_host_offloading"] is True
    assert cuda["xla_gpu_all_gather_combine_threshold_bytes"] == 128 * 2**20
    assert "xla_gpu_enable_while_loop_double_buffering" in cuda
    # Each option under its name or, for an XLA before the name (jaxlib < 0.12.1), an older spelling.
    for option in runtime.GPU_OPTIONS:
        spelt = [(n, v) for n, v in ((option.name, option.value), *option.older) if n in cuda]
        assert len(spelt) == 1 and cuda[spelt[0][0]] == spelt[0][1], (option.name, spelt)
    assert {"xla_gpu_pipeline_all_gather", "xla_gpu_enable_pipelined_all_gather"} & set(cuda)
    for option in (*runtime.GPU_OPTIONS, *runtime.TPU_OPTIONS):
        assert option.why and option.source, option.name
    assert runtime.step_xla_options("cpu") == {}  # CPU runs and tests compile as before
    text = runtime.describe_xla_options("cuda", cuda)
    assert "xla_gpu_enable_latency_hiding_scheduler=True" in text and "JAX-Toolbox" in text


def test_unknown_options_are_dropped_with_one_warning():
    with pytest.warns(runtime.XlaOptionWarning) as caught:
        got = runtime.step_xla_options("gpu", {"xla_gpu_no_such_option": True, "xla_gpu_also_not_here": 3})
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "xla_gpu_no_such_option" in message and "xla_gpu_also_not_here" in message
    assert "xla_gpu_no_such_option" not in got and got["xla_gpu_enable_latency_hiding_scheduler"] is True
    # libtpu's options are not in this jaxlib's CPU/GPU debug options: all dropped, one warning, no error.
    with pytest.warns(runtime.XlaOptionWarning) as caught:
        assert runtime.step_xla_options("tpu") == {}
    assert len(caught) == 1 and "xla_tpu_host_transfer_overlap_limit" in str(caught[0].message)


def test_overrides_and_no_defaults():
    got = runtime.step_xla_options("gpu", {"xla_gpu_enable_highest_priority_async_stream": False})
    assert got["xla_gpu_enable_highest_priority_async_stream"] is False and len(got) == len(runtime.GPU_OPTIONS)
    only = runtime.step_xla_options("gpu", {"xla_gpu_enable_latency_hiding_scheduler": True}, defaults=False)
    assert only == {"xla_gpu_enable_latency_hiding_scheduler": True}
    assert runtime.parse_xla_option("--xla_gpu_enable_pipelined_all_reduce=false") == (
        "xla_gpu_enable_pipelined_all_reduce", False)  # fmt: skip
    assert runtime.parse_xla_option("xla_gpu_all_reduce_combine_threshold_bytes=1024")[1] == 1024
    assert runtime.parse_xla_option("xla_lhs_prioritize_async_depth_over_stall=ENABLED")[1] == "ENABLED"
    for bad in ("xla_gpu_enable_latency_hiding_scheduler", "=true", "key="):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            runtime.parse_xla_option(bad)


def test_the_step_is_compiled_with_its_options():
    """The options reach the step's compile: an option XLA refuses fails it (which is why the
    loop filters them first), and the GPU set, which XLA:CPU accepts and ignores, changes nothing."""
    model = zoo.Llama(preset("tiny"), key=jr.key(0))
    cfg = ztrain.TrainConfig(steps=2, batch_size=2, seq_len=16, warmup=1)
    tx = ztrain.optimizer(cfg, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    args = (params, tx.init(params), jnp.ones((1, 2, 16), jnp.int32), jnp.int32(1))
    refused = ztrain.make_train_step(model, cfg, tx, xla_options={"xla_gpu_no_such_option": True})
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        refused.trace(*args).lower().compile()
    plain = ztrain.make_train_step(model, cfg, tx).trace(*args).lower().compile()
    gpu = ztrain.make_train_step(model, cfg, tx, xla_options=runtime.step_xla_options("cuda"))
    a, b = plain(*jax.tree.map(jnp.copy, args))[2], gpu(*jax.tree.map(jnp.copy, args))[2]
    np.testing.assert_array_equal(np.asarray(a["loss"]), np.asarray(b["loss"]))


@pytest.fixture
def fresh_backend(monkeypatch):
    """As before JAX's backends start, with this machine's memory 100 GiB and the pool's variable unset."""
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(runtime, "physical_memory", lambda: 100 * GiB)
    monkeypatch.delenv(runtime.HOST_POOL_ENV, raising=False)
    return monkeypatch


def test_host_pool_sized_before_the_backend_starts(fresh_backend):
    import os

    assert runtime.size_host_pool(10 * GiB) == runtime.HOST_POOL_DEFAULT_GIB  # XLA's 64 GiB hold it
    assert runtime.HOST_POOL_ENV not in os.environ
    assert runtime.size_host_pool(80 * GiB) == math.ceil(80 * 1.1) + 1  # a tenth and 1 GiB to spare
    assert os.environ[runtime.HOST_POOL_ENV] == str(math.ceil(80 * 1.1) + 1)


def test_host_pool_refuses_what_cannot_be(fresh_backend):
    from jax._src import xla_bridge

    with pytest.raises(zoo.ConfigError, match=r"needs 150.0 GiB .* more than the machine's 100.0 GiB"):
        runtime.size_host_pool(150 * GiB, what="the plan")
    fresh_backend.setenv(runtime.HOST_POOL_ENV, "32")  # the user's own cap, too small: named, not overridden
    with pytest.raises(zoo.ConfigError, match=f"{runtime.HOST_POOL_ENV}=32 caps XLA's pool at 32 GiB"):
        runtime.size_host_pool(40 * GiB)
    fresh_backend.delenv(runtime.HOST_POOL_ENV)
    fresh_backend.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    with pytest.raises(zoo.ConfigError, match="backend already started"):
        runtime.size_host_pool(70 * GiB)


def _recipe():
    spec = importlib.util.spec_from_file_location("zoo_train_recipe_xla", ROOT / "recipes" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_flags(capsys):
    recipe = _recipe()
    args = recipe.parse_args(["--xla-option", "xla_gpu_enable_pipelined_all_reduce=false", "--xla-option",
                              "xla_gpu_all_gather_combine_threshold_bytes=1024", "--no-xla-defaults",
                              "--steps", "6", "--profile", "3:5"])  # fmt: skip
    assert args.xla_options == {"xla_gpu_enable_pipelined_all_reduce": False,
                                "xla_gpu_all_gather_combine_threshold_bytes": 1024}  # fmt: skip
    assert args.no_xla_defaults and args.profile == (3, 5)
    for flags, message in ((["--xla-option", "nonsense"], "--xla-option: expected KEY=VALUE"),
                           (["--steps", "6", "--profile", "5:3"], "--profile 5:3: records steps"),
                           (["--steps", "6", "--profile", "3"], "expected START:STOP")):  # fmt: skip
        with pytest.raises(SystemExit):
            recipe.parse_args(flags)
        assert message in capsys.readouterr().err


def test_recipe_sizes_the_pool_from_the_placements(fresh_backend, capsys, tmp_path):
    """Parameters and optimizer state in host memory: the pool holds the step's estimated host
    bytes; a machine too small for them is an error naming both figures (the recipe's usage error)."""
    import os

    recipe = _recipe()
    fresh_backend.delenv("JAX_PLATFORMS", raising=False)
    base = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "32"]
    auto.size_host_pool_from_flags(recipe.parse_args(base))  # nothing in host memory: nothing to size
    assert "pinned host memory" not in capsys.readouterr().out
    args = recipe.parse_args([*base, "--param-memory", "pinned_host", "--opt-memory", "pinned_host"])
    auto.size_host_pool_from_flags(args)
    assert "GiB estimated for this process; XLA's pool capped at 64 GiB" in capsys.readouterr().out
    assert runtime.HOST_POOL_ENV not in os.environ  # the default holds a tiny model's 1 MB
    fresh_backend.setattr(runtime, "physical_memory", lambda: 2**20)  # a 1 MiB machine
    with pytest.raises(zoo.ConfigError, match="more than the machine's 0.0 GiB"):
        auto.size_host_pool_from_flags(args)
    with pytest.raises(SystemExit):  # the recipe, before anything compiles
        recipe.main([*base, "--param-memory", "pinned_host", "--opt-memory", "pinned_host", "--steps", "1",
                     "--run-dir", str(tmp_path / "run")])  # fmt: skip
    assert "more than the machine's 0.0 GiB" in capsys.readouterr().err
    fresh_backend.setenv("JAX_PLATFORMS", "cpu")  # XLA:CPU has one memory and no pool: nothing sized
    auto.size_host_pool_from_flags(args)


def test_recipe_placement_auto_caps_the_pool_at_the_machine_and_checks_the_plan(fresh_backend, capsys):
    """``--placement auto`` plans after the backend starts, so the pool is capped at the machine's
    memory beforehand; the plan's host bytes for this process's devices are then checked against
    the machine and against a cap the user set lower, each an error naming the figures."""
    import os
    import types

    recipe = _recipe()
    fresh_backend.delenv("JAX_PLATFORMS", raising=False)
    auto.size_host_pool_from_flags(recipe.parse_args(["--preset", "tiny", "--placement", "auto"]))
    assert os.environ[runtime.HOST_POOL_ENV] == "100"  # the 100 GiB machine, over XLA's 64 GiB default

    def plan(host_gib: float):
        return types.SimpleNamespace(estimate=types.SimpleNamespace(host_bytes=host_gib * GiB))

    auto.check_plan_host_memory(plan(40), devices=2)  # 80 GiB of 100: fits
    auto.check_plan_host_memory(plan(0), devices=8)  # nothing on host: nothing to check
    with pytest.raises(zoo.ConfigError, match=r"the plan needs 120.0 GiB of pinned host memory on this process, "
                                              r"more than the machine's 100.0 GiB"):  # fmt: skip
        auto.check_plan_host_memory(plan(30), devices=4)
    fresh_backend.setenv(runtime.HOST_POOL_ENV, "32")  # the user's own, lower cap
    with pytest.raises(zoo.ConfigError, match=f"{runtime.HOST_POOL_ENV}=32 caps XLA's pool at 32 GiB: "
                                              f"set {runtime.HOST_POOL_ENV}=45"):  # fmt: skip
        auto.check_plan_host_memory(plan(40), devices=1)


@pytest.mark.host_memory
def test_measure_host_link_times_both_directions():
    from zoo.plan.hardware import measure_host_link

    to_host, to_device = measure_host_link(nbytes=4 * 2**20, repeats=2)
    assert all(np.isfinite(r) and r > 1e6 for r in (to_host, to_device)), (to_host, to_device)  # > 1 MB/s: it ran


def test_an_option_this_xla_knows_only_by_an_older_name_is_set_by_that_name(monkeypatch):
    """jaxlib 0.12.1 renamed the collective pipelining switches (xla_gpu_pipeline_* modes for the
    xla_gpu_enable_pipelined_* booleans): a default goes by the first spelling the installed XLA
    takes, silently; a user's value under an older spelling replaces the default's."""
    renamed = runtime.XlaOption("xla_gpu_no_such_option_yet", 3, "why", "source",
                                (("xla_gpu_not_this_one_either", 1), ("xla_gpu_enable_latency_hiding_scheduler", False)))  # fmt: skip
    monkeypatch.setitem(runtime.XLA_OPTIONS, "gpu", (renamed,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime.step_xla_options("gpu") == {"xla_gpu_enable_latency_hiding_scheduler": False}
    assert runtime.step_xla_options("gpu", {"xla_gpu_enable_latency_hiding_scheduler": True}) == {
        "xla_gpu_enable_latency_hiding_scheduler": True}  # fmt: skip
    text = runtime.describe_xla_options("gpu", {"xla_gpu_enable_latency_hiding_scheduler": False})
    assert "(why; source)" in text
    gone = runtime.XlaOption("xla_gpu_no_such_option_yet", 3, "why", "source", (("xla_gpu_nor_this", 1),))
    monkeypatch.setitem(runtime.XLA_OPTIONS, "gpu", (gone,))
    with pytest.warns(runtime.XlaOptionWarning, match="xla_gpu_no_such_option_yet"):
        assert runtime.step_xla_options("gpu") == {}
