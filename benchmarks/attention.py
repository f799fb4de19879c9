"""Attention paths on this machine: forward + backward time of each, and how far each is from
float32 dense attention's values and gradients.

    python benchmarks/attention.py [--dtype bfloat16] [--seqs 1024,4096] [--repeats 3]

Every path :func:`zoo.layers.attention.causal_attention` has that runs compiled here (``xla``
and ``blockwise`` everywhere, ``cudnn`` and ``pallas_gpu`` on a GPU (this JAX permitting: 0.12.1 dropped
the Triton kernel), ``splash`` on a TPU; a
Pallas kernel off its backend would only be interpreted, so it is left out), on Llama 3.1 8B's
attention shape (32 query heads, 8 key/value heads of 128), batch 1, each S of ``--seqs``, one
document a row and packed rows (four documents a row: segment ids). For each: milliseconds per
forward + backward (compiled, timed interleaved, best of ``--repeats``), and the largest
difference from the dense path's output and gradients computed in float32 on the same inputs,
relative to their largest entry (in bf16 every path's rounding shows there; a kernel that is
wrong is off by order 1). cuDNN is left out for packed rows, which it does not take. Prints one
markdown table. On a GPU this is the first run of the Triton kernel on its own hardware: the
error column is its check.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from zoo.layers import pallas_attention
from zoo.layers.attention import causal_attention, use_cudnn

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seqs", default="1024,4096", help="comma-separated sequence lengths")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def paths_here(dtype, packed: bool) -> list[str]:
    paths = ["xla", "blockwise"]
    if use_cudnn(dtype, packed):
        paths.append("cudnn")
    paths += [k for k, backend in pallas_attention.BACKENDS.items() if backend == jax.default_backend()
              and (k != "pallas_gpu" or pallas_attention.gpu_kernel_available())]  # (gone from jax 0.12.1)
    return paths


@jax.jit
def reference(q, k, v, ct, seg):
    """The dense path in float32 on the same (already rounded) inputs: output and gradients."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
    out, vjp = jax.vjp(
        lambda q, k, v: causal_attention(q, k, v, scale=HEAD_DIM**-0.5, segment_ids=seg, implementation="xla"), *f32[:3]
    )
    return out, vjp(f32[3])


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    rows = []
    for s in map(int, args.seqs.split(",")):
        keys = jax.random.split(jax.random.key(s), 4)
        q = jax.random.normal(keys[0], (1, s, HEADS, HEAD_DIM), dtype)
        k = jax.random.normal(keys[1], (1, s, KV_HEADS, HEAD_DIM), dtype)
        v = jax.random.normal(keys[2], (1, s, KV_HEADS, HEAD_DIM), dtype)
        ct = jax.random.normal(keys[3], (1, s, HEADS, HEAD_DIM), dtype)
        for packed in (False, True):
            seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), -(-s // 4))[None, :s] if packed else None
            fns, results = {}, {}
            for path in paths_here(dtype, packed):

                def step(q, k, v, path=path, seg=seg, ct=ct):
                    out, vjp = jax.vjp(
                        lambda q, k, v: causal_attention(q, k, v, scale=HEAD_DIM**-0.5, segment_ids=seg, implementation=path),
                        q, k, v,
                    )  # fmt: skip
                    return out, vjp(ct)

                fns[path] = jax.jit(step)
                results[path] = jax.block_until_ready(fns[path](q, k, v))  # compile + warm up
            best = {p: float("inf") for p in fns}
            for _ in range(args.repeats):  # interleaved: a busy machine slows every path alike
                for path, fn in fns.items():
                    t = time.perf_counter()
                    jax.block_until_ready(fn(q, k, v))
                    best[path] = min(best[path], time.perf_counter() - t)
            ref_out, ref_grads = reference(q, k, v, ct, seg)
            for path in fns:
                out, grads = results[path]
                err = max(
                    float(
                        jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()
                        / jnp.abs(b.astype(jnp.float32)).max()
                    )
                    for a, b in zip((out, *grads), (ref_out, *ref_grads))
                )
                rows.append((s, "packed" if packed else "one document", path, 1e3 * best[path], err))
    device = jax.devices()[0]
    print(f"Attention forward + backward, {HEADS} query / {KV_HEADS} key-value heads of {HEAD_DIM}, batch 1, "
          f"{dtype.name}, {device.platform} ({device.device_kind}); error: largest difference from float32 dense "
          "attention's output and gradients over their largest entry.\n")  # fmt: skip
    print("| S | rows | path | ms | error vs float32 dense |")
    print("|---:|---|---|---:|---:|")
    for s, kind, path, ms, err in rows:
        print(f"| {s} | {kind} | {path} | {ms:.1f} | {err:.1e} |")


if __name__ == "__main__":
    main(sys.argv[1:])
