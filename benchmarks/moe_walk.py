"""The planner's liveness walk against XLA's own memory for MoE training steps.

    python benchmarks/moe_walk.py                          # 8 simulated CPU devices, float32
    python benchmarks/moe_walk.py --tpu-topology v5e:2x4   # on a TPU machine: 8 chips, ahead of time, bf16

The ``small`` presets' steps (DeepSeek-V3, Qwen3-MoE) under full remat, 8 rows of 512 and 2,048
tokens, on expert-parallel and FSDP meshes, at the default capacity factor and at 1.0 (later
rounds in the program). For each: XLA's figure for the compiled step (on a TPU topology its
``peak_bytes`` per chip, the step's memory; on CPU arguments + outputs + temporaries - aliases,
one memory), the walk's estimate of the same traced program (``zoo.plan.measure``'s
``predicted``), and their ratio. Nothing runs. docs/planning.md ("Caveats") holds the tables.
"""

from __future__ import annotations

import argparse
import dataclasses

ROWS = [
    ("deepseek_v3", "fsdp=2,expert=4", 512, None),
    ("deepseek_v3", "fsdp=2,expert=4", 2048, None),
    ("deepseek_v3", "fsdp=2,expert=4", 512, 1.0),
    ("deepseek_v3", "fsdp=2,expert=4", 2048, 1.0),
    ("deepseek_v3", "expert=8", 2048, 1.0),
    ("deepseek_v3", "fsdp=8", 512, None),
    ("qwen3_moe", "fsdp=2,expert=4", 512, None),
    ("qwen3_moe", "fsdp=2,expert=4", 2048, None),
]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tpu-topology", default=None, help="compile for 8 chips of this TPU topology, e.g. v5e:2x4")
    args = p.parse_args(argv)

    import jax

    devices = None
    if args.tpu_topology is None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    else:
        from jax.experimental import topologies

        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=args.tpu_topology).devices)
    import jax.numpy as jnp

    from zoo import plan, registry

    dtype = jnp.float32 if devices is None else jnp.bfloat16
    where = "8 CPU devices, float32" if devices is None else f"8 chips of TPU {args.tpu_topology}, bf16, ahead of time"
    print(f"MoE steps (`small`, 8 rows, full remat) on {where}: XLA's memory against the walk's\n")
    print("| model | mesh | capacity factor | tokens | XLA MB | walk MB | walk / XLA |")
    print("|---|---|---:|---:|---:|---:|---:|")
    out = []
    for family, mesh, seq, factor in ROWS:
        config = registry.by_model_type(family).config_cls.preset("small", family)
        if factor is not None:
            config = dataclasses.replace(config, capacity_factor=factor)
        m = plan.measure(config, batch_size=8, seq_len=seq, mesh=mesh, placement="remat", devices=devices,
                         compute_dtype=dtype)  # fmt: skip
        xla = m.device_bytes if devices is None else m.peak_bytes
        walk = m.predicted.device_bytes
        row = {"model": family, "mesh": mesh, "factor": factor or config.capacity_factor, "tokens": seq, "xla": xla,
               "walk": walk}  # fmt: skip
        out.append(row)
        print(f"| {family} | `{mesh}` | {row['factor']} | {seq} | {xla / 1e6:.1f} | {walk / 1e6:.1f} | "
              f"{walk / xla:.3f} |", flush=True)  # fmt: skip
    return out


if __name__ == "__main__":
    main()
