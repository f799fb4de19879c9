"""The MoE dispatch's bytes moved and held per device against the routed rows.

    python benchmarks/moe_dispatch.py [--tokens 2048] [--width 512] [--hidden 256] [--experts 32] [--top-k 4]

One MoE layer's routed experts (forward and backward, ``zoo.layers.moe.routed_experts`` with
the ``capacity`` kernel) on 8 simulated CPU devices, tokens split over the batch axes, for
``expert=8`` and ``fsdp=2,expert=4``, balanced routing. For each dispatch it prints, per device
and step, the all-to-all bytes of the compiled program (every all-to-all's result, forward and
backward: what the planner reads, :func:`zoo.plan.collectives.hlo_traffic`), the rows one
token all-to-all moves against the device's T·K routed rows, XLA's temporary buffers for the
whole program, and the step time (simulated devices share the machine's cores: total work, not
a cluster's network).

The peer is zoo's previous dispatch, a slot per destination for all of a device's T·K pairs
(the worst case: ``capacity_factor = expert``, which this module reproduces exactly), measured
in the same run; the ratios are against it.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per device")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256, help="expert hidden width")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import jax.random as jr
    from jax.sharding import PartitionSpec as P

    from zoo import parallel
    from zoo.hooks.step import step_context
    from zoo.layers.moe import Routing, pair_mlp_for, routed_experts, routed_experts_dense
    from zoo.layers.moe_dispatch import Dispatch
    from zoo.plan.collectives import hlo_traffic, shape_bytes

    t, d, m, e, k = args.tokens, args.width, args.hidden, args.experts, args.top_k
    kx, kr, kw, kg, ku, kd = jr.split(jr.key(0), 6)
    x = jr.normal(kx, (8 * t, d))
    experts = jnp.argsort(jr.uniform(kr, (8 * t, e)), axis=-1)[:, :k].astype(jnp.int32)
    weights = jax.nn.softmax(jr.normal(kw, (8 * t, k)), axis=-1)
    w = [jr.normal(key, s) / s[1] ** 0.5 for key, s in ((kg, (e, d, m)), (ku, (e, d, m)), (kd, (e, m, d)))]

    def program(mesh, dispatch):
        batch = tuple(a for a in ("data", "fsdp", "expert") if mesh.shape[a] > 1)

        def body(x, experts, weights, wg, wu, wd):
            with step_context(mesh, {}):

                def local(x, weights, w):
                    routing = Routing(experts, weights, jnp.zeros((x.shape[0], e)))
                    out, _ = routed_experts(routed_experts_dense, x, routing, *w, pair_mlp=pair_mlp_for("capacity"),
                                            dispatch=dispatch)  # fmt: skip
                    return jnp.sum(out * out)

                value, grads = jax.value_and_grad(local, (0, 1, 2))(x, weights, (wg, wu, wd))
            return jax.lax.psum(value, batch), grads

        tok, ex = P(batch), P("expert")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, ex, ex, ex),
                                     out_specs=(P(), (tok, tok, (ex, ex, ex))), check_vma=True))  # fmt: skip

    rows = []
    print(f"one MoE layer, forward + backward: {t} tokens/device, D={d}, M={m}, E={e}, K={k}; 8 CPU devices\n")
    print("| mesh | dispatch | rows moved / routed | all-to-all MiB / step | temp MiB | ms / step "
          "| bytes vs peer | temp vs peer | time vs peer |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec in ("expert=8", "fsdp=2,expert=4"):
        mesh = parallel.make_mesh(spec)
        n = mesh.shape["expert"]
        peer = None
        for label, dispatch in ((f"peer: worst-case slot (= capacity_factor {n})", Dispatch(float(n))),
                                ("capacity_factor 1.25, dropless", Dispatch(1.25)),
                                ("capacity_factor 1.0, dropless", Dispatch(1.0))):  # fmt: skip
            fn = program(mesh, dispatch)
            compiled = fn.lower(x, experts, weights, *w).compile()
            hlo = compiled.as_text()
            moved = hlo_traffic(hlo, dict(mesh.shape)).get(("all_to_all", ("expert",)), 0)
            results = [line.split(" all-to-all(")[0].split("=", 1)[1] for line in hlo.splitlines() if " all-to-all(" in line]
            token_rows = max(shape_bytes(r) for r in results) // (4 * d)  # the largest: a token buffer
            temp = compiled.memory_analysis().temp_size_in_bytes
            times = []
            for _ in range(args.steps + 1):
                start = time.perf_counter()
                jax.block_until_ready(fn(x, experts, weights, *w))
                times.append(time.perf_counter() - start)
            ms = 1e3 * statistics.median(times[1:])
            row = {"mesh": spec, "dispatch": label, "rows": token_rows / (t * k), "bytes": moved, "temp": temp, "ms": ms}
            peer = peer or row
            rows.append(row)
            print(f"| {spec} | {label} | {row['rows']:.2f}x | {moved / 2**20:.1f} | {temp / 2**20:.1f} | {ms:.0f} "
                  f"| {moved / peer['bytes']:.3f}x | {temp / peer['temp']:.3f}x | {ms / peer['ms']:.2f}x |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
