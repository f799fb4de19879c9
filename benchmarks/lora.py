"""LoRA and QLoRA against full fine-tuning: memory and step time on the CPU, and the
planner's figures for Llama 3.1 8B and 70B on one H100.

    python benchmarks/lora.py [--preset llama3.2-1b] [--batch-size 1] [--seq-len 256] [--steps 2]
                              [--no-time] [--no-planner] [--out FILE]

Measured (part 1): a model of ``--preset``'s shape (random weights, float32 parameters and
compute, full remat), its training step compiled by XLA:CPU for full fine-tuning (the peer,
in the same run), LoRA (r 16, alpha 32, ``all-linear``) and QLoRA (the same adapters on the
layer stacks in NF4, ``zoo.lora.nf4``), the NF4 base on the device and in pinned host memory
between steps. Per row: XLA's memory (``zoo.plan.measure``: arguments + outputs + temporaries
- aliases of the compiled step), its ratio to full fine-tuning's, the planner's estimate of the
same step (``zoo.plan.estimate``, one memory as XLA:CPU counts) and its error against XLA
(issue 41's target: within 10%), and the median time of ``--steps`` steps after one warm-up,
where the step fits the machine's available memory (XLA:CPU has one memory: the host row's
bytes count as the device's, and its transfers are copies). float32, because XLA:CPU computes
bfloat16 through float32 copies that a GPU's or TPU's program does not hold, and the planner
prices the latter (on the ``small`` preset in bfloat16 it is 29-45% under XLA:CPU's figure).

Planned (part 2): ``zoo.plan.plan`` for Llama 3.1 8B and 70B (bfloat16 parameters, 4,096
tokens) on one H100 (80 GB, 10% kept for the estimate's error): full fine-tuning, LoRA and
QLoRA as above; per row the largest fastest batch that fits, its placement, device and host
GiB and the priced tokens/s, or the smallest peak when nothing fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import zoo
from zoo import lora, plan
from zoo import train as ztrain
from zoo.core.params import run_state
from zoo.llama import preset
from zoo.lora import nf4
from zoo.placement import tree_placement

ADAPTERS = lora.LoraConfig(r=16, alpha=32, targets=(lora.ALL_LINEAR,))
DROPOUT = dataclasses.replace(ADAPTERS, dropout=0.05)
GIB, MIB = 2**30, 2**20


def variants(base: Any, *, key: Any) -> list[tuple[str, Any, str]]:
    """``(name, model, param_memory)``: full fine-tuning, LoRA, QLoRA on device and on host, and
    LoRA with PEFT's dropout (0.05, ``zoo.lora.dropout``)."""
    adapted = lora.init(base, ADAPTERS, key=key) if not _abstract(base) else _abstract_lora(base)
    quantized = nf4.quantize_model(base)
    qlora = lora.init(quantized, ADAPTERS, key=key) if not _abstract(base) else _abstract_lora(quantized)
    dropping = lora.LoraModel(base=adapted.base, adapters=adapted.adapters, lora=DROPOUT)
    return [("full fine-tuning", base, "device"), ("LoRA", adapted, "device"), ("QLoRA (NF4)", qlora, "device"),
            ("QLoRA, base on host", qlora, "pinned_host"), ("LoRA, dropout 0.05", dropping, "device")]  # fmt: skip


def _abstract(model: Any) -> bool:
    return isinstance(jax.tree.leaves(model)[0], jax.ShapeDtypeStruct)


def _abstract_lora(base: Any) -> Any:
    return eqx.filter_eval_shape(lambda b: lora.init(b, ADAPTERS, key=jr.key(0)), base)


def timed_steps(model: Any, param_memory: str, batch_size: int, seq_len: int, steps: int) -> float:
    """Median seconds of ``steps`` training steps after one warm-up (synthetic tokens)."""
    cfg = ztrain.TrainConfig(steps=steps + 1, batch_size=batch_size, seq_len=seq_len, warmup=0)
    tx = ztrain.optimizer(cfg, model)
    step = ztrain.make_train_step(model, cfg, tx, placement="remat", param_memory=param_memory)
    params = jax.tree.map(jnp.copy, run_state(model)[0])
    opt_state = tx.init(eqx.filter(params, eqx.is_inexact_array))
    if param_memory != "device":
        params = tree_placement(params, param_memory)
    ids = jr.randint(jr.key(1), (1, batch_size, seq_len), 0, model.config.vocab_size)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, ids, jnp.int32(i))
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def available_bytes() -> int:
    """The memory this machine can give the steps now (``MemAvailable``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def measured(args: argparse.Namespace) -> list[str]:
    print(f"building {args.preset} (float32) and quantizing its layer stacks ...", flush=True)
    base = zoo.Llama(preset(args.preset), key=jr.key(0))
    available = available_bytes()
    kw = {"batch_size": args.batch_size, "seq_len": args.seq_len, "placement": "remat"}
    rows, peer = [], None
    for name, model, where in variants(base, key=jr.key(1)):
        start = time.perf_counter()
        got = plan.measure(model, param_memory=where, **kw)
        est = plan.estimate(model, unified_memory=True, param_memory=where, **kw)
        fits = got.device_bytes < 0.9 * available
        seconds = timed_steps(model, where, args.batch_size, args.seq_len, args.steps) if args.time and fits else float("nan")
        peer = got.device_bytes if peer is None else peer
        rows.append((name, got.device_bytes, est.device_bytes, nf4.nbytes(run_state(model)[0]), seconds))
        print(f"{name}: XLA {got.device_bytes / GIB:.2f} GiB, estimate {est.device_bytes / GIB:.2f} GiB, "
              f"step {seconds:.2f} s ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    n = sum(x.size for x in jax.tree.leaves(base))
    lines = [
        (f"**Measured on XLA:{jax.devices()[0].platform.upper()}** ({os.cpu_count()} cores, "
         f"{args.preset} shape: {n / 1e9:.2f}B parameters, float32 parameters and compute, full remat, "
         f"batch {args.batch_size} x {args.seq_len} tokens; LoRA r={ADAPTERS.r} alpha={ADAPTERS.alpha:g} all-linear; "
         f"{available / GIB:.1f} GiB available to run steps in, a step that needs more is compiled only: nan). "
         "The peer is full fine-tuning, compiled (and run, where it fits) in the same invocation."),
        "",
        ("| run | run state GiB | XLA GiB | / full fine-tuning | planner GiB | planner vs XLA | s / step | "
         "/ full fine-tuning | / LoRA |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    full_time, lora_time = rows[0][4], rows[1][4]
    for name, xla, est, state, seconds in rows:
        lines.append(f"| {name} | {state / GIB:.2f} | {xla / GIB:.2f} | {xla / peer:.3f} | {est / GIB:.2f} | "
                     f"{est / xla - 1:+.1%} | {seconds:.2f} | {seconds / full_time:.2f} | {seconds / lora_time:.2f} |")  # fmt: skip
    if math.isnan(full_time) and args.time:
        lines += ["", (f"Full fine-tuning's step needs {rows[0][1] / GIB:.1f} GiB, more than the {available / GIB:.1f} "
                       "available: compiled, not run (the time peer of the QLoRA rows is LoRA).")]  # fmt: skip
    return lines


def planned(args: argparse.Namespace) -> list[str]:
    lines = [
        "",
        ("**Planned for one H100** (`zoo.plan.plan`, hardware `h100`, 4,096 tokens, bfloat16 parameters, "
         "each plan verified by its trace; LoRA as above):"),
        "",
        "| model | run | fits | batch | map, parameters, optimizer state | device GiB | host GiB | tokens/s |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for name in ("llama3.1-8b", "llama3.1-70b"):
        abstract = jax.eval_shape(
            lambda name=name: zoo.Llama(preset(name), key=jr.key(0), param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
        )
        for run, model, _ in variants(abstract, key=jr.key(1))[:3]:
            start = time.perf_counter()
            try:
                p = plan.plan(model, seq_len=4096, hardware="h100", compute_dtype=jnp.bfloat16)
            except plan.NothingFits as e:
                lines.append(f"| {name} | {run} | no | - | smallest peak {e.device_peak / GIB:.1f} GiB | - | - | - |")
            else:
                lines.append(f"| {name} | {run} | yes | {p.batch_size} | {p.placement.spec()}, {p.param_memory}, "
                             f"{p.opt_memory} | {p.estimate.device_bytes / GIB:.1f} | {p.estimate.host_bytes / GIB:.1f} "
                             f"| {p.tokens_per_s:,.0f} |")  # fmt: skip
            print(lines[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3.2-1b", help="the Llama preset whose shape is measured")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    p.add_argument("--no-time", dest="time", action="store_false", help="compile only: no steps run")
    p.add_argument("--no-planner", dest="planner", action="store_false", help="leave out part 2")
    p.add_argument("--no-measured", dest="measured", action="store_false", help="leave out part 1 (XLA's compiled steps)")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    lines = (measured(args) if args.measured else []) + (planned(args) if args.planner else [])
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
