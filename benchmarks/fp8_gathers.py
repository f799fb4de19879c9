"""FSDP gathers in FP8: the bytes a tensorwise FP8 step's weight all-gathers move, against the
same step gathering in the compute dtype (the peer, ``zoo.layers.fp8.fp8_gathers(False)``).

    python benchmarks/fp8_gathers.py [--out FILE]

1. **XLA's program** (8 simulated CPU devices): the ``small`` presets' training step under
   ``--precision fp8_all`` and full remat, compiled (``make_train_step``, 8 rows of 256 tokens),
   and the bytes of its all-gathers over the weight axes (``fsdp``, ``expert``) read from the
   compiled HLO (:func:`zoo.plan.collectives.hlo_traffic`), with their ratio. Float32 compute:
   XLA:CPU moves a bfloat16 all-gather as float32, so a bf16 step's CPU program would not show
   what a GPU moves; in float32 a code is a quarter of its weight's bytes.
2. **The planner** (``zoo.plan.mesh_plan.cost_model``, bf16 compute, as on the hardware): the
   same comparison for Llama 3.1 405B on 128 H100 (``fsdp=128``) and the seed's DeepSeek-V3
   671B on 128 GB200 (``fsdp=16,expert=8``): the step's forward weight-gather bytes per device,
   the exposed collective seconds and the step time under full remat.

The step's numbers are the same either way (``tests/test_precision.py``).
"""

from __future__ import annotations

import argparse
import time

CPU_ROWS = [
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


def cpu_row(family: str, mesh_spec: str, fp8_gathers: bool) -> int:
    import equinox as eqx
    import jax.numpy as jnp
    import jax.random as jr

    from zoo import parallel, registry
    from zoo.layers import fp8
    from zoo.plan import collectives
    from zoo.train import TrainConfig, make_train_step, optimizer

    fam = registry.by_model_type(family)
    model = fam(fam.config_cls.preset("small", family), key=jr.key(0))
    cfg = TrainConfig(batch_size=8, seq_len=256, warmup=0, precision="fp8_all")
    tx = optimizer(cfg, model)
    mesh = parallel.make_mesh(mesh_spec)
    params = parallel.shard(eqx.filter(model, eqx.is_inexact_array), mesh)
    opt = parallel.init_optimizer(tx, params, mesh)
    ids = jnp.zeros((1, 8, 256), jnp.int32)
    with fp8.fp8_gathers(fp8_gathers):
        compiled = make_train_step(model, cfg, tx, mesh=mesh, placement="remat").lower(
            params, opt, ids, jnp.int32(0)).compile()  # fmt: skip
    sizes = {a: int(n) for a, n in mesh.shape.items()}
    return weight_gathers(collectives.hlo_traffic(compiled.as_text(), sizes))


def planned_row(family: str, preset: str, mesh: str, hardware: str, seq: int, fields: dict, fp8_gathers: bool):
    import dataclasses

    import jax.numpy as jnp

    from zoo import registry
    from zoo.layers import fp8
    from zoo.plan.mesh_plan import cost_model

    config = dataclasses.replace(registry.by_model_type(family).config_cls.preset(preset, family), **fields)
    with fp8.fp8_gathers(fp8_gathers):
        cm = cost_model(config, seq_len=seq, mesh=mesh, hardware=hardware, compute_dtype=jnp.bfloat16,
                        precision="fp8_all")  # fmt: skip
    forward = sum(v[0] for (kind, axes, when, _), v in cm.traffic.lines.items()
                  if kind == "all_gather" and when == "forward" and set(axes) <= {"fsdp", "expert"})  # fmt: skip
    step, _ = cm.time(cm.map_cls.preset("remat"), 1, "device", "pinned_host", 1)
    exposed = next(iter(cm.comm.values()))
    return forward, exposed, step


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="also write the tables to this file")
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)

    lines = [("Compiled training steps (`small`, float32, 8 rows of 256 tokens, full remat, `fp8_all`, 8 CPU devices): "
              "bytes of the weight all-gathers in XLA's program"), "",
             "| model | mesh | FP8 gathers MB | compute-dtype gathers MB (peer) | ratio | s |", "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for family, mesh in CPU_ROWS:
        t = time.time()
        fp8_bytes, peer = cpu_row(family, mesh, True), cpu_row(family, mesh, False)
        lines.append(f"| {family} | `{mesh}` | {fp8_bytes / 1e6:.2f} | {peer / 1e6:.2f} | {fp8_bytes / peer:.3f} | {time.time() - t:.0f} |")
        print(lines[-1], flush=True)
    lines += ["", ("The planner (bf16 compute, `fp8_all`, full remat, one row of the sequence per device, optimizer "
                   "state in pinned host memory): forward weight gathers per device and step, exposed collectives, step time"), "",
              "| model | mesh | hardware | tokens | FP8 gathers GB | peer GB | ratio | exposed s (FP8 / peer) | step s (FP8 / peer) |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for family, preset, mesh, hw, seq, fields in PLANNED:
        (g8, e8, s8), (g, e, s) = (planned_row(family, preset, mesh, hw, seq, fields, on) for on in (True, False))
        lines.append(f"| {preset} | `{mesh}` | {hw} | {seq} | {g8 / 1e9:.1f} | {g / 1e9:.1f} | {g8 / g:.3f} | "
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
