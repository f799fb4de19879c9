"""MoE layer: forward + backward time of the dropless expert paths vs every expert on every token.

    python benchmarks/moe.py [--tokens 1024] [--experts 64] [--top-k 8] [--d-model 512] [--hidden 256]
    python benchmarks/moe.py --bench-shape          # the shared bench shape (16 experts, top-2)

Prints one markdown table: milliseconds per forward+backward for each path and the ratio of
the dense path to zoo's default dropless path (``grouped`` off TPU). The dense path does E/K
times the expert FLOPs; the dropless paths pay a sort and gathers (``tiled``: up to twice the
routed FLOPs in one batched einsum; ``grouped``: a loop over row tiles, the routed FLOPs). ``jax.lax.ragged_dot`` is
shown too: off TPU, jaxlib expands it to a masked dense product.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zoo.deepseek_v3.moe import EXPERT_IMPLS, resolve_expert_impl, route  # noqa: E402


def time_fn(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench(tokens: int, d: int, experts: int, hidden: int, top_k: int, dtype, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens, d)), dtype)
    router = jnp.asarray(rng.standard_normal((d, experts)) * d**-0.5, jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.02, dtype) for s in [(experts, d, hidden)] * 2 + [(experts, hidden, d)]]
    bias = jnp.zeros(experts)

    def make(impl):
        def loss(x, ws):
            r = route(x, router, bias, top_k=top_k, n_group=1, topk_group=1, norm_topk_prob=True, scaling=1.0)
            return jnp.sum(impl(x, r, *ws).astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    fns = {name: make(impl) for name, impl in EXPERT_IMPLS.items()}
    # Same numbers first: the benchmark compares equal work products.
    losses = {name: float(fn(x, ws)[0]) for name, fn in fns.items()}
    for name, value in losses.items():
        np.testing.assert_allclose(value, losses["dense"], rtol=1e-3, err_msg=name)
    row = {name: time_fn(fn, x, ws, repeats=repeats) for name, fn in fns.items()}
    return {"shape": f"T={tokens} D={d} E={experts} M={hidden} top-{top_k}", **row}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--bench-shape", action="store_true", help="also run the shared bench shape (B4 x S256, 16 experts top-2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    rows = [bench(a.tokens, a.d_model, a.experts, a.hidden, a.top_k, dtype, a.repeats)]
    if a.bench_shape:
        rows.append(bench(4 * 256, 512, 16, 256, 2, dtype, a.repeats))
    print(f"MoE layer forward+backward, {jax.devices()[0].device_kind}, {a.dtype}, median of {a.repeats}\n")
    default = resolve_expert_impl("auto")
    print(f"| shape | grouped (ms) | tiled (ms) | ragged_dot (ms) | dense all-experts (ms) | dense / {default} |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['grouped']:.1f} | {r['tiled']:.1f} | {r['ragged_dot']:.1f} | {r['dense']:.1f} | {r['dense'] / r[default]:.2f}x |")


if __name__ == "__main__":
    main()
