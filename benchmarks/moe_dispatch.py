"""The MoE dispatch's bytes moved and held per device against the routed rows.

    python benchmarks/moe_dispatch.py [--tokens 2048] [--width 512] [--hidden 256] [--experts 32] [--top-k 4]
                                      [--tpu-topology v5e:2x4] [--hlo-dir DIR] [--fp8]

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

``--tpu-topology``: on a machine with a TPU, compile the same programs ahead of time for eight
chips of that topology (``jax.experimental.topologies``; nothing runs, so no times) and add the
ragged transport's rows (``Dispatch.transport="ragged"``: ``ragged_all_to_all``, which XLA:CPU
lacks). A ragged all-to-all's bytes are its smaller of operand and output (what it can send).
``--hlo-dir DIR`` writes each compiled program's optimized HLO there, one file a row.

``--fp8``: the routed experts' products tensorwise FP8 (``fp8_all``'s) and the tokens and weights
in bf16, and each dispatch at capacity factor 1.0 twice: its token rows sent as their E4M3 codes
(the figure) and in bf16 (the peer, ``zoo.layers.fp8.fp8_dispatch(False)``), with their ratio.
Try ``--width 7168`` (DeepSeek-V3's) with ``--tpu-topology``: XLA:TPU lays a ragged all-to-all's
rows out in whole (sublane, 128-lane) tiles, so a u8 row of 256 holds as many bytes as a bf16 one.
"""

from __future__ import annotations

import argparse
import pathlib
import re
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
    p.add_argument("--tpu-topology", default=None, help="compile for 8 chips of this TPU topology, e.g. v5e:2x4")
    p.add_argument("--hlo-dir", default=None, help="write each compiled program's optimized HLO in this folder")
    p.add_argument("--fp8", action="store_true", help="FP8 rows against bf16 rows (tensorwise routed experts)")
    args = p.parse_args(argv)

    import jax

    if args.tpu_topology is None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
        devices = None
    else:
        from jax.experimental import topologies

        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=args.tpu_topology).devices)
        if len(devices) != 8:
            raise SystemExit(f"--tpu-topology {args.tpu_topology}: {len(devices)} chips, the benchmark's meshes need 8")
    import jax.numpy as jnp
    import jax.random as jr
    from jax.sharding import PartitionSpec as P

    from zoo import parallel
    from zoo.hooks.step import step_context
    from zoo.layers import fp8
    from zoo.layers.moe import Routing, pair_mlp_for, routed_experts, routed_experts_dense
    from zoo.layers.moe_dispatch import Dispatch
    from zoo.plan.collectives import hlo_traffic

    t, d, m, e, k = args.tokens, args.width, args.hidden, args.experts, args.top_k
    kx, kr, kw, kg, ku, kd = jr.split(jr.key(0), 6)
    x = jr.normal(kx, (8 * t, d))
    experts = jnp.argsort(jr.uniform(kr, (8 * t, e)), axis=-1)[:, :k].astype(jnp.int32)
    weights = jax.nn.softmax(jr.normal(kw, (8 * t, k)), axis=-1)
    w = [jr.normal(key, s) / s[1] ** 0.5 for key, s in ((kg, (e, d, m)), (ku, (e, d, m)), (kd, (e, m, d)))]
    if args.fp8:
        x, weights, *w = (a.astype(jnp.bfloat16) for a in (x, weights, *w))
    recipes = dict.fromkeys(fp8.ROUTED, "tensorwise") if args.fp8 else None

    def program(mesh, dispatch, fp8_rows=False):
        batch = tuple(a for a in ("data", "fsdp", "expert") if mesh.shape[a] > 1)

        def body(x, experts, weights, wg, wu, wd):
            with step_context(mesh, {}), fp8.using(recipes):

                def local(x, weights, w):
                    routing = Routing(experts, weights, jnp.zeros((x.shape[0], e)))
                    out, _ = routed_experts(routed_experts_dense, x, routing, *w, pair_mlp=pair_mlp_for("capacity"),
                                            dispatch=dispatch, fp8_rows=fp8_rows)  # fmt: skip
                    return jnp.sum(out * out)

                value, grads = jax.value_and_grad(local, (0, 1, 2))(x, weights, (wg, wu, wd))
            return jax.lax.psum(value, batch), grads

        tok, ex = P(batch), P("expert")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, ex, ex, ex),
                                     out_specs=(P(), (tok, tok, (ex, ex, ex))), check_vma=True))  # fmt: skip

    rows = []
    where = "8 CPU devices" if devices is None else f"8 chips of TPU {args.tpu_topology}, compiled ahead of time"
    print(f"one MoE layer, forward + backward: {t} tokens/device, D={d}, M={m}, E={e}, K={k}; {where}\n")

    def compile_(fn, mesh):
        if devices is None:
            return fn.lower(x, experts, weights, *w).compile()
        return fn.lower(*(abstract(a, mesh) for a in (x, experts, weights)), *(abstract(a, mesh, "expert") for a in w)).compile()

    if args.fp8:
        print("tensorwise FP8 routed experts, bf16 tokens; the peer sends the token rows in bf16\n")
        print("| mesh | dispatch | FP8 rows: all-to-all MiB / step | bf16 rows (peer) | ratio | temp MiB | peer | ratio |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        transports = ["padded"] + (["ragged"] if devices is not None else [])
        for spec in ("expert=8", "fsdp=2,expert=4"):
            mesh = parallel.make_mesh(spec, devices=devices)
            for transport in transports:
                got = []
                for on in (True, False):
                    compiled = compile_(program(mesh, Dispatch(1.0, transport=transport), fp8_rows=on), mesh)
                    moved = hlo_traffic(compiled.as_text(), dict(mesh.shape)).get(("all_to_all", ("expert",)), 0)
                    got.append((moved, compiled.memory_analysis().temp_size_in_bytes))
                    rows.append({"mesh": spec, "dispatch": transport, "fp8_rows": on, "bytes": moved, "temp": got[-1][1]})
                (b8, t8), (b, tp) = got
                print(f"| {spec} | capacity_factor 1.0, {transport} | {b8 / 2**20:.2f} | {b / 2**20:.2f} | {b8 / b:.3f} "
                      f"| {t8 / 2**20:.1f} | {tp / 2**20:.1f} | {t8 / tp:.3f} |", flush=True)  # fmt: skip
        return rows
    # What the routed rows need a step: the token rows there and back and their two transposes
    # (float32), and the expert ids once.
    routed = t * k * (4 * d * 4 + 4)
    print("| mesh | dispatch | bytes moved / routed rows' | all-to-all MiB / step | temp MiB | ms / step "
          "| bytes vs peer | temp vs peer | time vs peer |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    dispatches = [("capacity_factor 1.25, dropless", Dispatch(1.25, transport="padded")),
                  ("capacity_factor 1.0, dropless", Dispatch(1.0, transport="padded"))]  # fmt: skip
    if devices is not None:
        dispatches += [("capacity_factor 1.25, dropless, ragged", Dispatch(1.25, transport="ragged")),
                       ("capacity_factor 1.0, dropless, ragged", Dispatch(1.0, transport="ragged"))]  # fmt: skip
    for spec in ("expert=8", "fsdp=2,expert=4"):
        mesh = parallel.make_mesh(spec, devices=devices)
        n = mesh.shape["expert"]
        peer = None
        for label, dispatch in [(f"peer: worst-case slot (= capacity_factor {n})", Dispatch(float(n), transport="padded")),
                                *dispatches]:  # fmt: skip
            fn = program(mesh, dispatch)
            compiled = compile_(fn, mesh)
            hlo = compiled.as_text()
            if args.hlo_dir:
                name = re.sub(r"[^a-z0-9]+", "_", f"{spec} {label}".lower()).strip("_")
                pathlib.Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                (pathlib.Path(args.hlo_dir) / f"{name}.hlo").write_text(hlo)
            moved = hlo_traffic(hlo, dict(mesh.shape)).get(("all_to_all", ("expert",)), 0)
            temp = compiled.memory_analysis().temp_size_in_bytes
            ms = float("nan")
            if devices is None:
                times = []
                for _ in range(args.steps + 1):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(x, experts, weights, *w))
                    times.append(time.perf_counter() - start)
                ms = 1e3 * statistics.median(times[1:])
            row = {"mesh": spec, "dispatch": label, "rows": moved / routed, "bytes": moved, "temp": temp, "ms": ms}
            peer = peer or row
            rows.append(row)
            timed = f"{ms:.0f}" if devices is None else "not run"
            ratio = f"{ms / peer['ms']:.2f}x" if devices is None else "-"
            print(f"| {spec} | {label} | {row['rows']:.2f}x | {moved / 2**20:.1f} | {temp / 2**20:.1f} | {timed} "
                  f"| {moved / peer['bytes']:.3f}x | {temp / peer['temp']:.3f}x | {ratio} |")  # fmt: skip
    return rows


def abstract(a, mesh, axis=None):
    """``a``'s shape and dtype, split over ``mesh``'s batch axes (or ``axis``), for an ahead-of-time compile."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = axis or tuple(x for x in ("data", "fsdp", "expert") if mesh.shape[x] > 1)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P(axes)))


if __name__ == "__main__":
    main()
