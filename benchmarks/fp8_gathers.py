"""FSDP gathers and expert dispatch in FP8: the bytes a tensorwise FP8 step's weight all-gathers
and expert all-to-alls move, against the same step gathering and dispatching in the compute dtype
(the peer, ``zoo.layers.fp8.fp8_gathers(False)`` and ``fp8_dispatch(False)``).

    python benchmarks/fp8_gathers.py [--out FILE]
    python benchmarks/fp8_gathers.py --tpu-topology v5e:2x4   # on a TPU machine: 8 chips, ahead of time, bf16
    python benchmarks/fp8_gathers.py --precision blockwise    # DeepSeek-V3's recipe everywhere (projections' gathers)

1. **XLA's program** (8 simulated CPU devices, or 8 chips of a TPU topology compiled ahead of
   time): the ``small`` presets' training step under ``--precision fp8_all`` and full remat
   (8 rows of 256 tokens), compiled (``zoo.plan.measure``), and the bytes of its all-gathers
   over the weight axes (``fsdp``, ``expert``) and of its all-to-alls over ``expert`` in the
   compiled HLO (``Estimate.collectives``), with their ratios. On CPU in float32: XLA:CPU moves a bfloat16 all-gather as float32, so a bf16
   step's CPU program would not show what an accelerator moves; in float32 a code is a quarter
   of its weight's bytes. On a TPU in bf16 (half).
2. **The planner** (``zoo.plan.mesh_plan.cost_model``, bf16 compute, as on the hardware): the
   same comparison for Llama 3.1 405B on 128 H100 (``fsdp=128``) and the seed's DeepSeek-V3
   671B on 128 GB200 (``fsdp=16,expert=8``): the step's forward weight-gather and all-to-all
   bytes per device, the exposed collective seconds and the step time under full remat.

The step's numbers are the same either way (``tests/test_precision.py``).
"""

from __future__ import annotations

import argparse
import time

COMPILED = [
    ("llama", "fsdp=8"),
    ("llama", "fsdp=4,tensor=2"),
    ("deepseek_v3", "fsdp=8"),
    ("deepseek_v3", "fsdp=2,expert=4"),
]
PLANNED = [
    ("llama", "llama3.1-405b", "fsdp=128", "h100", 4096, {}),
    ("llama", "llama3.1-405b", "fsdp=128", "h100", 1024, {}),
    ("deepseek_v3", "deepseek-v3-671b", "fsdp=16,expert=8", "gb200", 4096, {"capacity_factor": 1.0}),
]


def weight_gathers(traffic: dict) -> int:
    return sum(v for (kind, axes), v in traffic.items() if kind == "all_gather" and set(axes) <= {"fsdp", "expert"})


def all_to_alls(traffic: dict) -> int:
    return sum(v for (kind, _), v in traffic.items() if kind == "all_to_all")


def compiled_row(family: str, mesh: str, in_fp8: bool, devices, dtype, precision: str) -> tuple[int, int]:
    import jax
    import jax.random as jr

    from zoo import plan, registry
    from zoo.layers import fp8

    fam = registry.by_model_type(family)
    # The routed experts run FP8 on the capacity path only (a TPU's default is ragged_dot).
    options = {"expert_impl": "capacity"} if family == "deepseek_v3" else {}
    model = jax.eval_shape(lambda: fam(fam.config_cls.preset("small", family), key=jr.key(0), compute_dtype=dtype,
                                       **options))  # fmt: skip
    with fp8.fp8_gathers(in_fp8), fp8.fp8_dispatch(in_fp8):
        m = plan.measure(model, batch_size=8, seq_len=256, mesh=mesh, placement="remat", precision=precision,
                         devices=devices)  # fmt: skip
    return weight_gathers(m.collectives), all_to_alls(m.collectives)


def planned_row(family: str, preset: str, mesh: str, hardware: str, seq: int, fields: dict, in_fp8: bool,
                precision: str):  # fmt: skip
    import dataclasses

    import jax.numpy as jnp

    from zoo import registry
    from zoo.layers import fp8
    from zoo.plan.mesh_plan import cost_model

    config = dataclasses.replace(registry.by_model_type(family).config_cls.preset(preset, family), **fields)
    with fp8.fp8_gathers(in_fp8), fp8.fp8_dispatch(in_fp8):
        cm = cost_model(config, seq_len=seq, mesh=mesh, hardware=hardware, compute_dtype=jnp.bfloat16,
                        precision=precision)  # fmt: skip
    # The traffic's lines are polynomials in the local batch (bytes = c0 + c1·b): at one row.
    lines = cm.traffic.lines.items()
    gathers = sum(cs[0] for (kind, axes, when, _), cs in lines
                  if kind == "all_gather" and when == "forward" and set(axes) <= {"fsdp", "expert"})  # fmt: skip
    moves = sum(sum(cs) for (kind, *_), cs in lines if kind == "all_to_all")
    step, _ = cm.time(cm.map_cls.preset("remat"), 1, "device", "pinned_host", 1)
    exposed = next(iter(cm.comm.values()))
    return gathers, moves, exposed, step


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="also write the tables to this file")
    p.add_argument("--tpu-topology", default=None, help="compile for 8 chips of this TPU topology, e.g. v5e:2x4")
    p.add_argument("--precision", default="fp8_all", help="the precision map's spec (fp8_all, blockwise, ...)")
    args = p.parse_args(argv)
    spec = args.precision

    import jax

    devices = None
    if args.tpu_topology is None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    else:
        from jax.experimental import topologies

        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=args.tpu_topology).devices)
    import jax.numpy as jnp

    dtype, where = (jnp.float32, "float32, 8 CPU devices") if devices is None else (
        jnp.bfloat16, f"bf16, 8 chips of TPU {args.tpu_topology} compiled ahead of time")  # fmt: skip
    lines = [(f"Compiled training steps (`small`, {where}, 8 rows of 256 tokens, full remat, `{spec}`): "
              "bytes of the weight all-gathers in XLA's program"), "",
             "| model | mesh | FP8 gathers MB | compute-dtype gathers MB (peer) | ratio | FP8 all-to-alls MB | peer MB | ratio | s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for family, mesh in COMPILED:
        t = time.time()
        (g8, a8), (g, a) = (compiled_row(family, mesh, on, devices, dtype, spec) for on in (True, False))
        moves = f"{a8 / 1e6:.2f} | {a / 1e6:.2f} | {a8 / a:.3f}" if a else "- | - | -"
        lines.append(f"| {family} | `{mesh}` | {g8 / 1e6:.2f} | {g / 1e6:.2f} | {g8 / g:.3f} | {moves} | {time.time() - t:.0f} |")
        print(lines[-1], flush=True)
    lines += ["", (f"The planner (bf16 compute, `{spec}`, full remat, one row of the sequence per device, optimizer "
                   "state in pinned host memory): forward weight gathers and all-to-alls per device and step, exposed "
                   "collectives, step time"), "",
              ("| model | mesh | hardware | tokens | FP8 gathers GB | peer GB | ratio | FP8 all-to-alls GB | peer GB | ratio "
               "| exposed s (FP8 / peer) | step s (FP8 / peer) |"),
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for family, preset, mesh, hw, seq, fields in PLANNED:
        (g8, a8, e8, s8), (g, a, e, s) = (planned_row(family, preset, mesh, hw, seq, fields, on, spec)
                                          for on in (True, False))  # fmt: skip
        moves = f"{a8 / 1e9:.2f} | {a / 1e9:.2f} | {a8 / a:.3f}" if a else "- | - | -"
        lines.append(f"| {preset} | `{mesh}` | {hw} | {seq} | {g8 / 1e9:.1f} | {g / 1e9:.1f} | {g8 / g:.3f} | {moves} | "
                     f"{e8:.3f} / {e:.3f} | {s8:.3f} / {s:.3f} |")  # fmt: skip
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
