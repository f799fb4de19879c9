"""Profiles and placements proven in the run: ``--profile START:STOP`` writes a trace that
``recipes/profile.py`` reports per step (layer and named-tensor scopes named); the report's
arithmetic on a GPU-shaped trace; every named tensor's ops under its scope in the step's HLO; a
placement map whose offload cannot happen stops the run naming the tensor."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from families import tiny, tiny_ids

import zoo
import zoo.placement
from zoo import train as ztrain
from zoo.data import stdlib_corpus
from zoo.llama import preset
from zoo.train import trace_report
from zoo.train.trace_report import Event

ROOT = Path(__file__).resolve().parents[1]


def _event(line, name, start_us, end_us, **stats):
    plane = "/host:CPU" if line == "python" else "/device:GPU:0"
    return Event(plane, line, name, start_us * 1e3, end_us * 1e3, stats)


def test_report_of_a_gpu_trace_splits_hidden_and_exposed_copies():
    """One step of 1000 us: compute 0-600 us, an all-gather 600-700 us; a D2H copy 500-800 us
    (100 us under compute, 100 under the collective, 100 alone) and an H2D copy 900-1000 us
    (alone): 200 us hidden, 200 us exposed, 20% of the step."""
    events = [
        _event("python", trace_report.STEP_EVENT, 0, 1000, step_num=3),
        _event("Stream #7(Compute)", "loop_fusion", 0, 400, hlo_op="fusion.1"),
        _event("Stream #7(Compute)", "gemm", 400, 600, hlo_op="custom-call.2"),
        _event("Stream #9(Nccl)", "ncclDevKernel_AllGather_RING_LL", 600, 700, hlo_op="all-gather-start"),
        _event("Stream #13(MemcpyD2H)", "MemcpyD2H", 500, 800, memcpy_details="kind_src:device kind_dst:pinned size:3000000"),
        _event("Stream #14(MemcpyH2D)", "MemcpyH2D", 900, 1000, memcpy_details="kind_src:pinned kind_dst:device size:1000000"),
        _event("XLA Ops", "fusion.1", 0, 400),  # a derived line: not counted twice
        _event("Stream #7(Compute)", "late", 1500, 1600),  # after the step's window
    ]  # fmt: skip
    sources = {"fusion.1": "jit(step)/jvp()/while/body/decoder_layer/query/bsd,dhk->bshk/dot_general",
               "custom-call.2": "jit(step)/transpose(jvp(decoder_layer))/context/attn_lse/dot_general",
               "all-gather-start": "jit(step)/jvp()/while/body/decoder_layer/fsdp_gathered/all_gather"}  # fmt: skip
    report = trace_report.analyse(events, sources)
    assert report.device == "GPU:0" and len(report.steps) == 1
    s = report.steps[0]
    assert s.step == 3 and s.wall == pytest.approx(1e-3)
    assert s.compute == pytest.approx(600e-6) and s.collectives == pytest.approx(100e-6)
    assert (s.d2h.count, s.d2h.nbytes, s.h2d.count, s.h2d.nbytes) == (1, 3_000_000, 1, 1_000_000)
    assert s.d2h.rate() == pytest.approx(10.0) and s.h2d.rate() == pytest.approx(10.0)  # GB/s
    assert s.hidden == pytest.approx(200e-6) and s.exposed == pytest.approx(200e-6)
    assert report.regions["decoder layers, forward"] == pytest.approx(500e-6)  # the fusion and the all-gather
    assert report.regions["decoder layers, backward"] == pytest.approx(200e-6)
    # The innermost named tensor's scope: attn_lse inside context; the copies are under none.
    assert list(report.named) == ["query", "attn_lse", "fsdp_gathered", trace_report.NO_SOURCE]
    assert report.named["query"]["forward"] == pytest.approx(400e-6) and sum(report.named["query"].values()) == pytest.approx(400e-6)
    assert report.named["attn_lse"]["backward"] == pytest.approx(200e-6) and "context" not in report.named
    assert report.named["fsdp_gathered"]["forward"] == pytest.approx(100e-6)
    assert report.named[trace_report.NO_SOURCE]["other"] == pytest.approx(400e-6)  # the copies' 300 + 100 us
    text = trace_report.format_report(report)
    assert "20.0%" in text and "decoder layers, backward" in text
    assert any(line.split()[:2] == ["query", "0.40"] for line in text.splitlines())


def test_named_regions_and_phases_of_op_names():
    """The innermost named tensor of an op's source, whatever the transforms wrapped around the
    scopes; the pass from the transforms (recompute inside the backward pass counted apart)."""
    names = frozenset({"kv_a", "kv_latent", "query", "context", "attn_lse"})
    cases = {
        "jit(step)/jvp(decoder_layer)/kv_latent/kv_a/slice": ("kv_a", "forward"),
        "jit(step)/transpose(jvp())/while/body/checkpoint/decoder_layer/kv_latent/mul": ("kv_latent", "backward"),
        "jit(step)/transpose(jvp())/while/body/checkpoint/rematted_computation/decoder_layer/query/sin": ("query", "recompute"),
        "jit(step)/jvp()/while/body/decoder_layer/tf,fd->td/dot_general": (trace_report.UNNAMED, "forward"),
        "jit(step)/jvp()/cv,cd->vd/dot_general": (trace_report.OUTSIDE, "forward"),
        "jit(step)/adam/mul": (trace_report.OUTSIDE, "other"),
        "jit(step)/jvp()/decoder_layer/query": (trace_report.UNNAMED, "forward"),  # an op named like a tensor
        "": (trace_report.NO_SOURCE, "other"),
    }  # fmt: skip
    for source, (name, phase) in cases.items():
        assert (trace_report.named_region(source, names), trace_report.phase(source)) == (name, phase), source
    assert {"query", "mlp_hidden", "router_logits", "kv_latent", "q_proj", "fsdp_gathered"} <= trace_report.tensor_names()


def test_every_named_tensor_s_ops_run_under_its_scope():
    """A Llama train step under the ``remat`` map: in its lowered HLO every named tensor but the
    layer input (a name on the carry, computing nothing) is a scope of some op's ``op_name``
    ("decoder_layer/query/..."); in the compiled HLO the report finds each of query's and the
    MLP's named tensors forward, recomputed and backward."""
    model, ids = tiny("llama"), tiny_ids("llama")
    cfg = ztrain.TrainConfig(steps=2, batch_size=ids.shape[0], seq_len=ids.shape[1], warmup=1)
    tx = ztrain.optimizer(cfg, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    step = ztrain.make_train_step(model, cfg, tx, placement="remat")
    lowered = step.lower(params, tx.init(params), ids[None], jnp.int32(0))
    text = lowered.as_text(dialect="hlo", debug_info=True)
    # The query projection (jax 0.12.1 writes the whole scope path, "jit(step)/.../decoder_layer/...").
    assert re.search(r'op_name="(?:[^"]*/)?decoder_layer/query/bsd,dhk->bshk/dot_general"', text)
    scopes = {trace_report.named_region(s) for s in trace_report.hlo_sources(text).values()}
    names = set(zoo.LlamaPlacement.names())
    assert names - scopes <= {"layer_input"} and len(names) == 12
    sources = trace_report.hlo_sources(lowered.compile().as_text())
    found = {(trace_report.named_region(s), trace_report.phase(s)) for s in sources.values()}
    for name in ("query", "mlp_gate", "mlp_up", "mlp_hidden", "mlp_norm"):
        assert {(name, "forward"), (name, "recompute"), (name, "backward")} <= found, name


def test_hlo_sources_and_self_times():
    hlo = (
        'HloModule jit_step\n  %fusion.3 = f32[2]{0} fusion(f32[2]{0} %p), kind=kLoop, '
        'metadata={op_name="jit(step)/jvp()/decoder_layer/mul" source_file="x.py"}\n'
        '  ROOT %while.1 = (s32[]) while((s32[]) %t), condition=%c, body=%b, metadata={op_name="jit(step)/while"}\n'
    )
    assert trace_report.hlo_sources(hlo) == {"fusion.3": "jit(step)/jvp()/decoder_layer/mul", "while.1": "jit(step)/while"}
    # XLA:CPU: a while loop's event holds its body's ops on the same thread; self times add to the wall.
    outer = _event("t", "while.1", 0, 100, hlo_op="while.1")
    inner = [_event("t", "fusion.3", 10, 40, hlo_op="fusion.3"), _event("t", "fusion.3", 50, 90, hlo_op="fusion.3")]
    times = {(e.name, e.start): t for e, t in trace_report._self_times([outer, *inner])}
    assert times[("while.1", 0)] == pytest.approx(30e3) and sum(times.values()) == pytest.approx(100e3)


def test_recipe_profile_then_report(tmp_path):
    """On CPU: ``--steps 6 --profile 3:5`` writes the trace and what the report needs; the report
    prints steps 3 and 4, the decoder layers' regions, ops with their named-scope source, and says
    there are no copies on one memory."""
    run = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    train = [sys.executable, str(ROOT / "recipes" / "train.py"), "--preset", "tiny", "--steps", "6", "--profile", "3:5",
             "--batch-size", "2", "--seq-len", "32", "--eval-every", "6", "--peak-tflops", "1", "--run-dir", str(run)]  # fmt: skip
    out = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "XLA options of the step (cpu): none" in out.stdout and "profile of steps 3-4" in out.stdout
    folder = run / "profile"
    assert (folder / "step.hlo.txt").is_file() and (folder / "memory.prof").stat().st_size > 0
    assert json.loads((folder / "step.json").read_text())["steps"] == [3, 4]
    (trace,) = trace_report.find_traces(run)
    assert list(trace.parent.glob("*perfetto_trace.json.gz"))  # Perfetto reads this one
    report = subprocess.run([sys.executable, str(ROOT / "recipes" / "profile.py"), str(run)], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    lines = report.stdout.splitlines()
    steps = [line.split()[0] for line in lines if line.strip()[:1].isdigit() and "|" in line]
    assert steps == ["3", "4"]
    assert "no host<->device copies" in report.stdout
    assert "decoder layers, forward" in report.stdout and "decoder layers, backward" in report.stdout
    assert any("decoder_layer" in line for line in lines[lines.index(next(x for x in lines if x.startswith("top"))):])
    # The named tensors' table: attention's and the MLP's, each with forward and backward time.
    start = lines.index(next(x for x in lines if x.startswith("time by named tensor")))
    table = {r.split()[0]: [float(x) for x in r.split()[1:6]] for r in lines[start + 2 : lines.index("", start)]
             if not r.strip().startswith("(")}  # fmt: skip
    for name in ("query", "key", "value", "context", "attn_out", "mlp_gate", "mlp_up", "mlp_hidden"):
        forward, recompute, backward, other, total = table[name]
        assert forward > 0 and backward > 0 and recompute == 0 and total == pytest.approx(forward + backward + other, abs=0.02)
    assert "(unnamed, decoder layers)" in report.stdout and "(outside the layers)" in report.stdout
    empty = subprocess.run([sys.executable, str(ROOT / "recipes" / "profile.py"), str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert empty.returncode == 2 and "holds no trace" in empty.stderr


def _cfg(**kw):
    base = dict(steps=2, batch_size=2, seq_len=32, warmup=1, log_every=1, eval_every=2, eval_batches=1,
                checkpoint_every=2)  # fmt: skip
    return ztrain.TrainConfig(**{**base, **kw})


def test_profile_window_is_checked_before_anything_runs(tmp_path):
    data, model = stdlib_corpus(max_bytes=2**20), zoo.Llama(preset("tiny"), key=jr.key(0))
    with pytest.raises(zoo.ConfigError, match="profile needs a run dir"):
        ztrain.train(model, data, _cfg(), profile=(1, 2))
    with pytest.raises(zoo.ConfigError, match=r"need 1 <= START < STOP <= 3"):
        ztrain.train(model, data, _cfg(), run_dir=tmp_path, profile="2:9")


@pytest.mark.host_memory
def test_placements_are_proven_in_the_compiled_step(tmp_path, capsys):
    data, model = stdlib_corpus(max_bytes=2**20), zoo.Llama(preset("tiny"), key=jr.key(0))
    spec = "remat+mlp_norm=pinned_host,layer_input=pinned_host"
    ztrain.train(model, data, _cfg(), placement=spec, param_memory="pinned_host", opt_memory="pinned_host")
    assert ("placements checked in the compiled step: layer_input, mlp_norm offloaded to pinned host memory; "
            "parameters and optimizer state in pinned host memory") in capsys.readouterr().out  # fmt: skip


@pytest.mark.host_memory
def test_an_offload_that_cannot_happen_stops_the_run_naming_the_tensor(tmp_path, monkeypatch):
    """A checkpoint policy that saves what the map offloads (the offload silently not done): the
    run stops before its first step, naming the tensor."""
    def saving_policy(self):
        return jax.checkpoint_policies.save_only_these_names(*self.placed("device"), *self.placed("pinned_host"))

    monkeypatch.setattr(zoo.placement.PlacementMap, "policy", saving_policy)
    data, model = stdlib_corpus(max_bytes=2**20), zoo.Llama(preset("tiny"), key=jr.key(0))
    with pytest.raises(zoo.ConfigError, match=r"offloads mlp_norm but the step's CUDA lowering .* moves no such tensor"):
        ztrain.train(model, data, _cfg(), run_dir=tmp_path, placement="remat+mlp_norm=pinned_host")
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0]  # stopped before step 1


def test_a_damaged_profile_is_one_line_naming_the_file(tmp_path, capsys):
    """Issue 42, point 9: a corrupt trace or step.json, or a plain file given as the run dir,
    raised from inside the readers naming no file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_recipe", ROOT / "recipes" / "profile.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    session = tmp_path / "run" / "profile" / "plugins" / "profile" / "2026_01_01_00_00_00"
    session.mkdir(parents=True)
    trace = session / "host.xplane.pb"
    trace.write_bytes(b"\xff\x00 not a trace \x13\x37" * 5)
    (tmp_path / "file").write_text("x")
    step = tmp_path / "run" / "profile" / "step.json"
    for damage, culprit in ((lambda: step.write_text("{ not json"), step), (lambda: step.unlink(), trace),
                            (lambda: None, tmp_path / "file")):  # fmt: skip
        damage()
        with pytest.raises(SystemExit) as e:
            recipe.main([str(tmp_path / ("file" if culprit.name == "file" else "run"))])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err and f"error: {culprit}" in err, err
        assert len(err.strip().splitlines()[-1]) > 0 and err.count("error:") == 1
    with pytest.raises(trace_report.ProfileError, match=f"^{trace}: not a readable trace"):
        trace_report.read_events(trace)


def test_the_totals_say_they_sum_the_threads():
    """Issue 42, point 9: on 8 simulated CPU devices the totals (summed over the host threads)
    were 8x the steps' compute, unexplained. Two threads busy over the same 100 us: 100 us of
    compute a step, 200 us in the totals, and the report says why."""
    events = [Event("/host:CPU", "python", trace_report.STEP_EVENT, 0.0, 1e6, {"step_num": 1})]
    events += [Event("/host:CPU", f"thread {i}", "fusion", 0.0, 1e5, {"hlo_op": "fusion.1"}) for i in range(2)]
    report = trace_report.analyse(events, {})
    assert report.device == "cpu" and report.threads == 2 and report.steps[0].compute == pytest.approx(1e-4)
    assert sum(report.regions.values()) == pytest.approx(2e-4)
    text = trace_report.format_report(report)
    assert "the totals below add up the ops' time on all 2 host threads" in text and "0.20 ms" in text, text
