"""LoRA dropout's price: a LoRA step with PEFT's dropout against the same step without, on the
device present (XLA's peak and step time), and the planner's estimate of each.

    python benchmarks/lora_dropout.py [--preset llama3.2-1b] [--batch-size 8] [--seq-len 1024]
                                      [--dropout 0.05] [--steps 5] [--out FILE]

A Llama of ``--preset``'s shape (random weights, bfloat16 parameters and compute, full remat),
LoRA r 16, alpha 32 on every linear weight (``all-linear``), trained by ``zoo.train``'s step on
one batch of random tokens: the peer is the step without dropout, compiled and run in the same
invocation; the dropout rows draw their masks with zoo's generator (XLA's ``RngBitGenerator``,
16 bits an element: ``zoo.lora.dropout.mask``) and, for comparison, with JAX's default threefry
(``jax.random.bernoulli``). Per row: XLA's ``peak_memory_in_bytes`` and its ratio to the peer,
the median step time of ``--steps`` steps after one and its ratio, and the planner's estimate
(``zoo.plan.estimate``) against XLA's peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import zoo
from zoo import lora, plan
from zoo import train as ztrain
from zoo.core.params import run_state
from zoo.llama import preset
from zoo.lora import dropout

ADAPTERS = lora.LoraConfig(r=16, alpha=32, targets=(lora.ALL_LINEAR,))
GIB = 2**30


def threefry_mask(key, shape, rate):
    """JAX's default generator's Bernoulli draw (the comparison row)."""
    return jr.bernoulli(key, 1.0 - rate, shape)


def row(base, rate: float, args: argparse.Namespace) -> dict[str, float]:
    """XLA's peak, the median step time and the planner's estimate of one LoRA step."""
    model = lora.init(base, dataclasses.replace(ADAPTERS, dropout=rate), key=jr.key(1))
    cfg = ztrain.TrainConfig(steps=args.steps + 1, batch_size=args.batch_size, seq_len=args.seq_len, warmup=0)
    tx = ztrain.optimizer(cfg, model)
    step = ztrain.make_train_step(model, cfg, tx, placement="remat")
    params = jax.tree.map(jnp.copy, run_state(model)[0])
    opt = tx.init(eqx.filter(params, eqx.is_inexact_array))
    ids = jr.randint(jr.key(2), (1, args.batch_size, args.seq_len), 0, base.config.vocab_size)
    compiled = step.lower(params, opt, ids, jnp.int32(0)).compile()
    peak = compiled.memory_analysis().peak_memory_in_bytes
    times = []
    for i in range(args.steps + 1):
        start = time.perf_counter()
        params, opt, metrics = compiled(params, opt, ids, jnp.int32(i))
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    est = plan.estimate(model, batch_size=args.batch_size, seq_len=args.seq_len, placement="remat",
                        unified_memory=jax.devices()[0].platform == "cpu")  # fmt: skip
    return {"peak": float(peak), "seconds": statistics.median(times[1:]), "planner": float(est.device_bytes)}


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3.2-1b", help="the Llama preset whose shape is measured")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=5, help="timed steps after one")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    base = zoo.Llama(preset(args.preset), key=jr.key(0), param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    own = dropout.mask
    rows = {}
    for name, rate, mask in (("LoRA (the peer)", 0.0, own), (f"dropout {args.dropout:g}, zoo's masks", args.dropout, own),
                             (f"dropout {args.dropout:g}, threefry masks", args.dropout, threefry_mask)):  # fmt: skip
        dropout.mask = mask
        try:
            rows[name] = row(base, rate, args)
        finally:
            dropout.mask = own
        print(name, rows[name], flush=True)
    device = jax.devices()[0]
    peer = next(iter(rows.values()))
    lines = [
        (f"**{device.device_kind} ({device.platform})**, {args.preset} shape, bfloat16, full remat, batch "
         f"{args.batch_size} x {args.seq_len}, LoRA r={ADAPTERS.r} alpha={ADAPTERS.alpha:g} all-linear; the peer is "
         "the same step without dropout, in the same invocation."),
        "",
        "| run | XLA peak GiB | / peer | ms / step | / peer | planner GiB | planner vs XLA |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for name, r in rows.items():
        lines.append(f"| {name} | {r['peak'] / GIB:.2f} | {r['peak'] / peer['peak']:.3f} | {1e3 * r['seconds']:.0f} | "
                     f"{r['seconds'] / peer['seconds']:.2f} | {r['planner'] / GIB:.2f} | {r['planner'] / r['peak'] - 1:+.1%} |")  # fmt: skip
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
