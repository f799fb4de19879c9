"""Profiles and placements proven in the run: ``--profile START:STOP`` writes a trace that
``recipes/profile.py`` reports per step (layer scopes named); the report's arithmetic on a
GPU-shaped trace; a placement map whose offload cannot happen stops the run naming the tensor."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.random as jr
import pytest

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
    sources = {"fusion.1": "jit(step)/jvp()/while/body/decoder_layer/dot_general",
               "custom-call.2": "jit(step)/transpose(jvp())/while/body/decoder_layer/dot_general"}  # fmt: skip
    report = trace_report.analyse(events, sources)
    assert report.device == "GPU:0" and len(report.steps) == 1
    s = report.steps[0]
    assert s.step == 3 and s.wall == pytest.approx(1e-3)
    assert s.compute == pytest.approx(600e-6) and s.collectives == pytest.approx(100e-6)
    assert (s.d2h.count, s.d2h.nbytes, s.h2d.count, s.h2d.nbytes) == (1, 3_000_000, 1, 1_000_000)
    assert s.d2h.rate() == pytest.approx(10.0) and s.h2d.rate() == pytest.approx(10.0)  # GB/s
    assert s.hidden == pytest.approx(200e-6) and s.exposed == pytest.approx(200e-6)
    assert report.regions["decoder layers, forward"] == pytest.approx(400e-6)
    assert report.regions["decoder layers, backward"] == pytest.approx(200e-6)
    text = trace_report.format_report(report)
    assert "20.0%" in text and "decoder layers, backward" in text


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
