"""Pipeline parallelism: parameter bytes, collectives and the measured bubble on simulated CPU devices.

    python benchmarks/pipeline.py [--steps 3] [--batch 32] [--seq 32]

A small Llama (``zoo.llama.preset("tiny")`` widened to d_model 128, MLP 384, 8 layers), loss
and gradients under ``zoo.parallel.value_and_grad`` on 8 simulated CPU devices:

1. ``pipeline=P,fsdp=8/P`` for P = 2 and 4 against ``fsdp=8``: per-device parameter bytes
   (``parallel.param_bytes``) and the compiled step's collectives by kind and mesh axes
   (``zoo.plan.collectives.hlo_traffic``; collective-permutes are counted here from their
   ``source_target_pairs``, which ``hlo_traffic`` does not read).
2. The bubble: median step time at M = P and M = 4P micro-batches (same global batch) on
   ``pipeline=P``, beside GPipe's prediction t(M) ∝ (M+P-1)/M (M+P-1 ticks of 1/M of the work).

Caveat: the 8 simulated devices share the machine's cores, so the stages do not run at the
same time; a tick costs the sum of all stages' work, not one stage's, and the bubble's idle
devices cost nothing here. The measured ratio shows per-micro-batch overhead, not the bubble
a real cluster would see.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import time


def permutes(hlo: str, sizes: dict[str, int]) -> dict[tuple[str, ...], tuple[int, int]]:
    """Collective-permutes of a compiled program by the mesh axes their pairs cross:
    {axes: (instructions in the text, bytes of one execution of each, summed)}."""
    import numpy as np

    from zoo.plan.collectives import AXES, shape_bytes

    shape = [sizes.get(a, 1) for a in AXES]
    out: dict[tuple[str, ...], tuple[int, int]] = {}
    for line in hlo.splitlines():
        m = re.match(r"^\s*(?:ROOT\s+)?%[\w.-]+ = (.+?) collective-permute(?:-start)?\(", line)
        if not m:
            continue
        pairs = re.findall(r"\{(\d+),(\d+)\}", re.search(r"source_target_pairs=\{(.*?)\}\}", line).group(0))
        axes: set[str] = set()
        for a, b in pairs:
            coords = np.array(np.unravel_index([int(a), int(b)], shape))
            axes |= {ax for ax, (x, y) in zip(AXES, coords.tolist()) if x != y}
        key = tuple(a for a in AXES if a in axes)
        n, size = out.get(key, (0, 0))
        # An async start's result is a tuple of its operand and result: count one of them.
        out[key] = (n + 1, size + shape_bytes(m.group(1)) // (2 if "collective-permute-start(" in line else 1))
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args(argv)

    from zoo.runtime import retain_host_memory

    retain_host_memory()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp

    import zoo
    from zoo import parallel
    from zoo.hooks.pipeline import bubble
    from zoo.parallel.place import to_stage_order
    from zoo.plan.collectives import hlo_traffic

    config = dataclasses.replace(
        zoo.llama.preset("tiny"), num_layers=8, hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2,
        head_dim=32,
    )  # fmt: skip
    model = zoo.Llama(config, key=jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, config.vocab_size, dtype=jnp.int32)

    def run(spec: str, microbatches: int | None, virtual: int = 1):
        mesh = parallel.make_mesh(spec)
        sharded = to_stage_order(parallel.shard(model, mesh), mesh, virtual)
        step = parallel.value_and_grad(zoo.lm_loss, mesh, microbatches=microbatches, virtual_stages=virtual)
        t = time.perf_counter()
        compiled = jax.jit(step).lower(sharded, ids).compile()
        compile_s = time.perf_counter() - t
        times = []
        for _ in range(args.steps + 1):  # the first call is the warm-up
            t = time.perf_counter()
            loss, grads = compiled(sharded, ids)
            jax.block_until_ready(grads)
            times.append(time.perf_counter() - t)
        return mesh, sharded, compiled.as_text(), 1e3 * statistics.median(times[1:]), float(loss), compile_s

    print(f"Llama d_model {config.hidden_size}, MLP {config.intermediate_size}, {config.num_layers} layers, "
          f"batch {args.batch} x {args.seq}, float32 loss + gradients on 8 simulated CPU devices; "
          f"median of {args.steps} steps after a warm-up\n")  # fmt: skip

    results = {}
    base = run("fsdp=8", None)
    results["fsdp=8"] = base
    for P in (2, 4):
        for M in (P, 4 * P):
            results[f"pipeline={P},fsdp={8 // P} M={M}"] = run(f"pipeline={P},fsdp={8 // P}", M)
        results[f"pipeline={P},fsdp={8 // P} M={P} V=2"] = run(f"pipeline={P},fsdp={8 // P}", P, 2)

    print("1. Parameters and collectives (per device, one step; pipelined rows at M = P)\n")
    print("| mesh | param MB / device | vs fsdp=8 | collectives: kind over axes, MB "
          "| collective-permutes over axes: instructions, MB per execution of all of them |")  # fmt: skip
    print("|---|---:|---:|---|---|")
    base_bytes = parallel.param_bytes(base[1])
    for key in ("fsdp=8", "pipeline=2,fsdp=4 M=2", "pipeline=4,fsdp=2 M=4"):
        mesh, sharded, hlo, *_ = results[key]
        sizes = dict(mesh.shape)
        traffic = {k: v for k, v in hlo_traffic(hlo, sizes).items() if k[0] != "permute"}
        coll = ", ".join(f"{k} over {'+'.join(a)}: {v / 1e6:.2f}" for (k, a), v in sorted(traffic.items()))
        perm = ", ".join(
            f"{'+'.join(a) or 'none'}: {n}, {b / 1e6:.3f}" for a, (n, b) in sorted(permutes(hlo, sizes).items())
        )
        gathers_over_pipeline = [k for k in traffic if k[0] == "all_gather" and "pipeline" in k[1]]
        assert not gathers_over_pipeline, gathers_over_pipeline
        pb = parallel.param_bytes(sharded)
        print(f"| {key.split(' ')[0]} | {pb / 1e6:.3f} | {pb / base_bytes:.2f}x | {coll} | {perm or 'none'} |")
    print("\nNo all-gather crosses `pipeline` (checked); activations cross it by collective-permute.\n")

    print("2. The bubble: step time at M = P and M = 4P micro-batches, and interleaved (V = 2 chunks a "
          "stage) at M = P, same global batch\n")  # fmt: skip
    print("| P | ms at M=P | ms at M=4P | ms at M=P, V=2 | measured t(P)/t(4P) | GPipe (M+P-1)/M ratio "
          "| bubble M=P | bubble M=4P | bubble M=P, V=2 | compile s (M=P, 4P; V=2) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    out = {"fsdp=8 ms": base[3]}
    for P in (2, 4):
        a, b = results[f"pipeline={P},fsdp={8 // P} M={P}"], results[f"pipeline={P},fsdp={8 // P} M={4 * P}"]
        c = results[f"pipeline={P},fsdp={8 // P} M={P} V=2"]
        predicted = ((2 * P - 1) / P) / ((5 * P - 1) / (4 * P))
        print(f"| {P} | {a[3]:.0f} | {b[3]:.0f} | {c[3]:.0f} | {a[3] / b[3]:.2f} | {predicted:.2f} | {bubble(P, P):.2f} | "
              f"{bubble(P, 4 * P):.2f} | {bubble(P, P, 2):.2f} | {a[5]:.1f}, {b[5]:.1f}; {c[5]:.1f} |")  # fmt: skip
        out[f"P={P} M=P ms"], out[f"P={P} M=4P ms"], out[f"P={P} M=P V=2 ms"] = a[3], b[3], c[3]
    print(f"\nfsdp=8 (no pipeline): {base[3]:.0f} ms/step, compile {base[5]:.1f} s")
    losses = {k: v[4] for k, v in results.items()}
    print("losses: " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))
    print("\nCaveat: the 8 simulated CPU devices share this machine's cores, so the stages do not run "
          "concurrently: a step costs the sum of every stage's ticks. A stage in the bubble computes its layers "
          "on a masked-out input (no control flow skips it), so the bubble costs time here as on a cluster, "
          "but smaller micro-batches add per-tick overhead that a tiny model on CPU feels more.")  # fmt: skip
    spread = max(losses.values()) - min(losses.values())
    assert spread <= 1e-5 * abs(base[4]), f"losses differ by {spread}: {losses}"
    return out


if __name__ == "__main__":
    main()
