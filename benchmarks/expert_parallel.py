"""Expert parallelism: step time of the two token paths on simulated CPU devices.

    python benchmarks/expert_parallel.py [--mesh fsdp=2,expert=4] [--devices 8] [--batch 8] [--steps 4]

Loss and gradients of the DeepSeek-V3 bench shape (``zoo.deepseek_v3.preset("bench")``,
sequence 256) under ``zoo.parallel.value_and_grad`` on ``--devices`` simulated CPU devices, for

- **all-to-all** (the default ``batch_axes``, batch split over ``expert`` too): each device
  runs attention on its own tokens and sends each (token, expert) pair to its expert's device;
- **shared tokens** (``batch_axes=("data", "fsdp")``): the expert group holds the same tokens,
  repeats the non-expert work on them, runs only its own pairs and combines with a ``psum``.

Prints one markdown table: median ms per step after one warm-up, the loss (equal in both),
and the ratio. Simulated devices share the machine's cores, so the ratio measures total work,
not a real cluster's communication.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="fsdp=2,expert=4")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)

    from zoo.runtime import retain_host_memory

    retain_host_memory()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp

    import zoo
    from zoo import parallel
    from zoo.deepseek_v3 import deepseek_v3_loss, preset

    model = zoo.DeepseekV3(preset("bench"), key=jax.random.key(0))
    mesh = parallel.make_mesh(args.mesh)
    sharded = parallel.shard(model, mesh)
    ids = jax.random.randint(jax.random.key(1), (args.batch, 256), 0, model.config.vocab_size, dtype=jnp.int32)
    rows = {}
    for name, axes in (("all-to-all (batch split over expert)", parallel.BATCH_AXES),
                       ("shared tokens, psum", ("data", "fsdp"))):  # fmt: skip
        step = parallel.value_and_grad(deepseek_v3_loss, mesh, has_aux=True, batch_axes=axes)
        times = []
        for _ in range(args.steps + 1):
            t = time.perf_counter()
            value, grads = step(sharded, ids)
            jax.block_until_ready(grads)
            times.append(time.perf_counter() - t)
        rows[name] = (1e3 * statistics.median(times[1:]), float(value[0]))
    print(f"DeepSeek-V3 bench shape, batch {args.batch} x 256, loss + gradients, mesh {args.mesh} on "
          f"{args.devices} simulated CPU devices; median of {args.steps} steps\n")  # fmt: skip
    print("| token path | ms / step | loss |\n|---|---:|---:|")
    for name, (ms, loss) in rows.items():
        print(f"| {name} | {ms:.0f} | {loss:.6f} |")
    (a2a, _), (shared, _) = rows.values()
    print(f"\nall-to-all: {shared / a2a:.2f}x faster than shared tokens")
    return {name: ms for name, (ms, _) in rows.items()}


if __name__ == "__main__":
    main()
