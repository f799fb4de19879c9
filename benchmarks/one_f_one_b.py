"""The 1F1B schedule against GPipe: XLA's compiled temporaries as the micro-batches grow.

    python benchmarks/one_f_one_b.py [--seq 128] [--layers 8] [--micro 4,8,16] [--out FILE] [--tpu-topology v5e:2x4]

A Llama (``zoo.llama.preset("tiny")`` widened to d_model 128, MLP 384, ``--layers`` layers)
on 8 simulated CPU devices, ``pipeline=4,data=2``, one row per micro-batch and device (the
global batch grows with M), under full remat (``placement="remat"``: each layer's input kept)
and with no map (every named tensor kept), on GPipe's schedule and the interleaved one with
V = 2 chunks a stage (``virtual_stages=2``; the peer then GPipe's interleaved schedule). For each
M it prints, per device, XLA's temporary
buffers of the compiled training step (``zoo.plan.measure``: loss, gradients and AdamW's
update) under GPipe (the peer, measured in the same run) and 1F1B, their ratio, and the
planner's estimate of each (``zoo.plan.estimate``) against XLA's. Under GPipe a stage keeps all M
micro-batches' saved tensors; under 1F1B at most 2P - 1 = 7, whatever M (beyond that, the
micro-batches' own inputs: the stack's input and its cotangent, the RoPE tables, the ids).

``--tpu-topology``: on a machine with a TPU, compile the same steps ahead of time for eight chips
of that topology (``jax.experimental.topologies``, ``zoo.plan.measure(..., devices=...)``;
nothing runs). The figure is then XLA:TPU's ``peak_memory_in_bytes`` per chip, not its
temporaries: XLA:TPU reports 0 bytes of temporaries for a GPipe step whose peak is 45.8 MiB (its
buffers for the loops' saved tensors are not among them), and the planner's columns compare its
device estimate (separate device and host memories) with that peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro", default="4,8,16", help="micro-batch counts M, comma-separated")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    p.add_argument("--tpu-topology", default=None, help="compile for 8 chips of this TPU topology, e.g. v5e:2x4")
    args = p.parse_args(argv)

    import jax

    devices, where, unified = None, "8 CPU devices", True
    if args.tpu_topology is None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    else:
        from jax.experimental import topologies

        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=args.tpu_topology).devices)
        if len(devices) != 8:
            raise SystemExit(f"--tpu-topology {args.tpu_topology}: {len(devices)} chips, the benchmark's mesh needs 8")
        where, unified = f"8 chips of TPU {args.tpu_topology}, compiled ahead of time", False
    from zoo.llama import preset
    from zoo.plan import estimate, measure

    def xla(**kw) -> float:
        got = measure(config, devices=devices, **kw)
        return got.temporaries if devices is None else got.peak_bytes

    def planned(**kw) -> float:
        e = estimate(config, unified_memory=unified, **kw)
        return e.temporaries if devices is None else e.device_bytes

    config = dataclasses.replace(preset("tiny"), hidden_size=128, intermediate_size=384, num_layers=args.layers)
    rows = []
    for virtual in (1, 2):
        for placement in ("remat", None):
            for m in (int(x) for x in args.micro.split(",")):
                row = {"V": virtual, "map": placement or "none", "M": m}
                for schedule in ("gpipe", "1f1b"):
                    kw = {"batch_size": 2 * m, "seq_len": args.seq, "mesh": "pipeline=4,data=2", "placement": placement,
                          "microbatches": m, "schedule": schedule, "virtual_stages": virtual}  # fmt: skip
                    row[schedule], row[f"{schedule} planned"] = xla(**kw), planned(**kw)
                rows.append(row)
                print(row, flush=True)
    lines = [
        (f"Llama d_model 128, {args.layers} layers, seq {args.seq}, pipeline=4,data=2 ({where}), one row per "
         "micro-batch and device; " + ("XLA's compiled temporaries per device, KiB" if devices is None else
                                         "XLA:TPU's peak memory per chip, KiB")),
        "",
        "| V | map | M | GPipe (peer) | 1F1B | 1F1B / GPipe | planner: GPipe / XLA | planner: 1F1B / XLA |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['V']} | {r['map']} | {r['M']} | {r['gpipe'] / 1024:,.0f} | {r['1f1b'] / 1024:,.0f} | "
                     f"{r['1f1b'] / r['gpipe']:.2f} | {r['gpipe planned'] / r['gpipe']:.2f} | "
                     f"{r['1f1b planned'] / r['1f1b']:.2f} |")  # fmt: skip
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
