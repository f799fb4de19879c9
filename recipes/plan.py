"""Plan a training run's memory: the placement map and batch that train fastest on a hardware.

    python recipes/plan.py --model llama --preset llama3.1-405b --mesh fsdp=8,tensor=8 --hardware gb200 --seq-len 8192
    python recipes/plan.py --model deepseek_v3 --preset deepseek-v3-671b --mesh data=9,expert=8 --hardware gb200 --seq-len 4096
    python recipes/plan.py --model llama --preset small --seq-len 256 --device-budget-gib 0.1   # this machine's CPU
    python recipes/plan.py --model deepseek_v3 --preset deepseek-v3-671b --devices 128 --hardware gb200 --seq-len 4096

With ``--devices N`` and no ``--mesh`` the mesh is searched too (every mesh of N the model
accepts, pruned by memory, the best few planned in full) and the table of meshes is printed first.

Everything is traced from shapes on an abstract mesh of any size: nothing is allocated and no
accelerator is needed. Prints the candidates (no map, full remat, each preset, the plan) with
device and host memory per device, step time, MFU and the largest batch each fits, then the
plan's map, verified by a full estimate and by the CUDA export (offloaded names reach host).
Exits 1 with the table and what dominates the smallest peak when nothing fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from zoo.cli import Help
from zoo.core import registry
from zoo.hardware import HARDWARE


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=Help
    )
    p.add_argument("--model", default="llama", choices=registry.model_types(), help="model type")
    p.add_argument("--preset", default="small", help="a named config of the model type (llama3.1-405b, small, ...)")
    p.add_argument(
        "--mesh",
        default="",
        help="axis=size pairs: pipeline, data, fsdp, context, tensor, expert "
        "(default: one device, or searched with --devices)",
    )
    p.add_argument("--devices", type=int, default=None, help="device count: search the mesh (or check --mesh's size)")
    p.add_argument(
        "--top",
        type=int,
        default=5,
        help="with --devices: the meshes planned in full (the quick "
        "model ranks the others; the output says how many were planned)",
    )
    p.add_argument("--no-pipeline", action="store_true", help="with --devices: search no mesh with a pipeline axis")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="with a pipeline axis: the interleaved schedule's chunks per stage (default: searched; "
                        "1: GPipe only)")  # fmt: skip
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default=None,
                   help="with a pipeline axis: the pipeline schedule (default: both priced, the faster that fits)")
    p.add_argument("--hardware", default="cpu", help=f"one of {', '.join(HARDWARE)}")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: the largest that fits)")
    p.add_argument("--device-budget-gib", type=float, default=None, help="per device (default: the hardware's HBM)")
    p.add_argument(
        "--host-budget-gib", type=float, default=None, help="per device (default: the hardware's host memory)"
    )
    p.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="activations and matmuls (parameters stay float32)")  # fmt: skip
    p.add_argument("--precision", default=None,
                   help="the family's precision map (fp8_all, deepseek, 'fp8_all+mlp_down=none', ...: docs/precision.md): "
                        "its tensorwise FP8 matmuls priced at the hardware's FP8 peak")  # fmt: skip
    p.add_argument("--domain", type=int, default=None,
                   help="the job's devices in each fast domain, where it holds fewer than the hardware's (GB200: 64 "
                        "for jobs of 128+ GPUs, as NVIDIA places them: 16 trays a rack) (default: the hardware's)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="MoE models: the dispatch's all-to-all slot, x the mean routed rows (default: the config's, 1.25)")
    p.add_argument("--no-verify", action="store_true", help="skip the CUDA export check of the offloaded names")
    p.add_argument("--estimate", action="store_true", help="also print the plan's estimate, part by part")
    args = p.parse_args(argv)
    for flag, value, least in (("--device-budget-gib", args.device_budget_gib, "positive"),
                               ("--host-budget-gib", args.host_budget_gib, "non-negative"),
                               ("--batch-size", args.batch_size, "positive"), ("--devices", args.devices, "positive"),
                               ("--top", args.top, "positive"), ("--capacity-factor", args.capacity_factor, "positive"),
                               ("--domain", args.domain, "positive")):  # fmt: skip
        if value is not None and not (value > 0 or (value == 0 and least == "non-negative")):
            p.error(f"{flag} must be {least}, got {value}")

    import jax.numpy as jnp

    from zoo import plan as planning
    from zoo.errors import ConfigError, MeshError

    start = time.perf_counter()
    try:
        hw = planning.hardware(args.hardware)
        if args.domain is not None and args.domain > hw.domain:
            p.error(f"--domain must be at most {hw.name}'s {hw.domain} devices a fast domain, got {args.domain}")
        hw = planning.hardware(hw, domain=args.domain) if args.domain is not None else hw
        config = registry.by_model_type(args.model, "--model").config_cls.preset(args.preset, args.model)
        if args.capacity_factor is not None:
            if not hasattr(config, "capacity_factor"):
                p.error(f"--capacity-factor: {args.model} has no routed experts to dispatch")
            config = dataclasses.replace(config, capacity_factor=args.capacity_factor)
        gib = 2**30
        result = planning.plan(
            config,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            mesh=args.mesh or None,
            hardware=hw,
            device_budget=None if args.device_budget_gib is None else args.device_budget_gib * gib,
            host_budget=None if args.host_budget_gib is None else args.host_budget_gib * gib,
            compute_dtype=getattr(jnp, args.compute_dtype),
            verify=not args.no_verify,
            devices=args.devices,
            top=args.top,
            pipeline=not args.no_pipeline,
            virtual_stages=args.virtual_stages,
            schedule=args.schedule,
            precision=args.precision,
        )
    except planning.NothingFits as e:
        if e.candidates:
            print(planning.candidate_table(e.candidates))
        print(f"\n{e}\n({time.perf_counter() - start:.1f} s)", file=sys.stderr)
        return 1
    except (ConfigError, MeshError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result)
    if args.estimate:
        print()
        print(result.estimate)
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
