"""One TPU chip: each placement map's training step as XLA:TPU compiles and runs it, beside zoo.plan.

    python benchmarks/tpu.py [--models llama,deepseek_v3] [--preset bench] [--batch-size 16]
                             [--seq-len 1024] [--steps 4] [--out FILE]

XLA:CPU keeps host and device in one memory, so on CPU an offload map cannot show what it
saves; a TPU has real pinned host memory. For each model (its preset, float32 parameters, bf16
compute, AdamW) and each row of ``ROWS`` (a map, where parameters and optimizer state live):

- XLA:TPU device / host bytes: the planner's step (``zoo.plan.measure``) compiled on the chip,
  ``memory_analysis()``: arguments + outputs + temporaries - aliases, device and host apart;
- walk: ``zoo.plan.estimate``'s liveness walk of the same traced program, and walk / XLA;
- step ms: the median of ``--steps`` runs of zoo.train's jitted step (``make_train_step`` with
  the TPU's XLA options) after two untimed ones; planner ms: ``zoo.plan.price`` on the
  ``tpu-v5e`` table entry (efficiency uncalibrated: 0.6), and measured / planner;
- loss: the first ``2 + --steps`` steps' losses and gradient norms against the ``device`` row's
  (a placement changes memory and speed, never numerics): the largest relative difference.

Also the chip's bf16 matmul peak and its host link, measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

GiB = 2**30
# (label, map, parameters' memory, optimizer state's memory); a map None is no jax.checkpoint.
ROWS = (
    ("device", "device", "device", "device"),
    ("none", None, "device", "device"),
    ("remat", "remat", "device", "device"),
    ("save_matmuls", "save_matmuls", "device", "device"),
    ("offload", "offload", "device", "device"),  # the family's offload preset (OFFLOAD below)
    ("remat (state on host)", "remat", "pinned_host", "pinned_host"),
)
OFFLOAD = {"llama": "offload_attn", "qwen3": "offload_mlp", "qwen3_moe": "offload_mlp", "deepseek_v3": "maxtext_offload"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,deepseek_v3", help="comma-separated model types")
    p.add_argument("--preset", default="bench", help="each model's config preset")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4, help="timed steps per row (after two untimed ones)")
    p.add_argument("--rows", default=None, help="comma-separated labels of ROWS (default: all)")
    p.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--numerics-only", action="store_true", help="run the steps only: no planner, no memory figures")
    p.add_argument("--out", default=None, help="also write the markdown here")
    return p.parse_args(argv)


def matmul_peak(reps: int = 10) -> float:
    """bf16 FLOP/s of an 8192^3 product, the mean of ``reps`` after a warm-up: measured
    (``zoo.train.matmul_peak_flops`` gives the hardware table's peak for a chip in the table)."""
    import jax
    import jax.numpy as jnp

    n = 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = f(a)
    out.block_until_ready()
    return reps * 2 * n**3 / (time.perf_counter() - t)


def run_row(model, cfg, spec, param_memory, opt_memory, batch, steps):
    """(median step seconds, [(loss, grad norm)] per step) of zoo.train's step under one row."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from zoo import train as ztrain
    from zoo.placement import tree_placement
    from zoo.runtime import step_xla_options

    tx = ztrain.optimizer(cfg, model)
    step = ztrain.make_train_step(model, cfg, tx, placement=spec, param_memory=param_memory, opt_memory=opt_memory,
                                  xla_options=step_xla_options(jax.devices()[0].platform))  # fmt: skip
    params = jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array))  # the step donates them
    opt_state = tx.init(params)
    if param_memory != "device":
        params = tree_placement(params, param_memory, what="parameters")
    if opt_memory != "device":
        opt_state = tree_placement(opt_state, opt_memory, what="optimizer state")
    times, trace = [], []
    for i in range(2 + steps):
        t = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, batch, jnp.int32(i))
        jax.block_until_ready(metrics["loss"])
        if i >= 2:
            times.append(time.perf_counter() - t)
        trace.append((float(metrics["loss"]), float(metrics.get("grad_norm", math.nan))))
    return statistics.median(times), trace


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zoo import plan
    from zoo import train as ztrain
    from zoo.core import registry
    from zoo.hardware import measure_host_link

    device = jax.devices()[0]
    peak = matmul_peak()
    to_host, to_device = measure_host_link(device)
    hw = plan.hardware("tpu-v5e")
    lines = [
        (f"{device.device_kind} ({device.platform}), jax {jax.__version__}: bf16 matmul {peak / 1e12:.1f} TFLOP/s "
         f"measured ({hw.peak_flops / 1e12:.0f} in the table); host link {to_host / 1e9:.1f} GB/s to host, "
         f"{to_device / 1e9:.1f} to device, one chip alone ({hw.host_link / 1e9:.0f} assumed in the table)"),
        "",
    ]
    print(lines[0], file=sys.stderr, flush=True)
    rows = [r for r in ROWS if args.rows is None or r[0] in args.rows.split(",")]
    header = ("model", "row", "XLA device", "walk device", "walk / XLA", "XLA host", "walk host", "step ms",
              "planner ms", "measured / planner", "MFU", "first loss vs device", "all vs device")  # fmt: skip
    table = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    compute = jnp.dtype(args.compute_dtype)
    for name in args.models.split(","):
        cls = registry.by_model_type(name)
        config = cls.config_cls.preset(args.preset, name)
        model = cls(config, key=jax.random.key(0), compute_dtype=compute)
        cfg = ztrain.TrainConfig(steps=1000, batch_size=args.batch_size, seq_len=args.seq_len, warmup=10)
        rng = np.random.default_rng(0)
        batch = jnp.asarray(rng.integers(0, config.vocab_size, (1, args.batch_size, args.seq_len)), jnp.int32)
        flops = args.batch_size * args.seq_len * config.flops_per_token(args.seq_len)
        reference = None
        for label, spec, pm, om in rows:
            spec = OFFLOAD.get(name, "remat") if spec == "offload" else spec
            shown = f"{label} ({spec})" if label == "offload" else label
            kw = dict(batch_size=args.batch_size, seq_len=args.seq_len, placement=spec, param_memory=pm, opt_memory=om)
            try:
                if not args.numerics_only:
                    m = plan.measure(model, **kw)
                    walk = m.predicted
                    (priced,) = plan.price(model, {label: spec}, seq_len=args.seq_len, batch_size=args.batch_size,
                                           hardware=hw, param_memory=pm, opt_memory=om)  # fmt: skip
                seconds, trace = run_row(model, cfg, spec, pm, om, batch, args.steps)
            except Exception as e:  # noqa: BLE001  (one row failing is a finding, not the end of the run)
                table.append(f"| {name} | {shown} | failed: {type(e).__name__}: {str(e)[:200]} |")
                print(f"  {name} {label}: failed: {e!r}", file=sys.stderr, flush=True)
                continue
            if reference is None and label == "device":
                reference = trace
            rel = lambda a, b: abs(a - b) / abs(b)  # noqa: E731
            first = "-" if reference is None else f"{rel(trace[0][0], reference[0][0]):.1e}"
            every = "-" if reference is None else f"{max(rel(a, b) for r, t in zip(reference, trace) for a, b in zip(t, r)):.1e}"
            if args.numerics_only:
                table.append(f"| {name} | {shown} | - | - | - | - | - | {1e3 * seconds:.1f} | - | - | "
                             f"{flops / seconds / peak:.1%} | {first} | {every} |")  # fmt: skip
                print(table[-1], file=sys.stderr, flush=True)
                continue
            table.append(
                f"| {name} | {shown} | {m.device_bytes / GiB:.2f} GiB | {walk.device_bytes / GiB:.2f} GiB | "
                f"{walk.device_bytes / m.device_bytes:.3f} | {m.host_bytes / GiB:.2f} GiB | {walk.host_bytes / GiB:.2f} GiB | "
                f"{1e3 * seconds:.1f} | {1e3 * priced.step_time:.1f} | {seconds / priced.step_time:.2f} | "
                f"{flops / seconds / peak:.1%} | {first} | {every} |"
            )  # fmt: skip
            print(table[-1], file=sys.stderr, flush=True)
    precision = jax.config.jax_default_matmul_precision or "default"
    lines.append(f"{args.preset} presets, batch {args.batch_size} x {args.seq_len} tokens, float32 parameters, "
                 f"{args.compute_dtype} compute (matmul precision {precision}), AdamW; MFU against the measured bf16 "
                 "matmul peak; vs device: the relative difference of the first step's loss, and the largest of the "
                 f"first {2 + args.steps} steps' losses and gradient norms, from the device row's")  # fmt: skip
    lines += ["", *table]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
