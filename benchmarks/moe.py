"""MoE layer: forward + backward time of every expert path, beside transformers' experts.

    python benchmarks/moe.py                                  # the three shapes below, float32
    python benchmarks/moe.py --shapes bench --impls capacity,grouped --repeats 3
    python benchmarks/moe.py --torch-python /path/to/python   # + transformers' layer, same run

Shapes (T tokens, D width, E routed experts, M expert hidden, top-k): ``bench`` the shared
bench shape (batch 4 x 256 tokens, 16 experts top-2), ``64e`` 64 experts top-8, ``dsv3`` 256
experts top-8 under DeepSeek-V3's group limit (8 groups, 4 kept) at a reduced width. Each
shape's routing comes from DeepSeek-V3's router on random weights, so experts get unequal rows
(as in training, balanced by the bias only on average).

Prints one markdown table: milliseconds per forward + backward of the routed experts (weights
and combine included, the router not) for each path; the default path's achieved GFLOP/s of
routed work (18·P·D·M FLOPs for P = T·k pairs: three matmuls forward, twice that backward)
against the matmul peak measured in the same run; its dispatch alone (the same kernel with
M = 0: sort, layout, gathers, combine); and transformers' ``DeepseekV3Experts`` (its default
experts implementation, same routing, same float32) when ``--torch-python`` names an
interpreter with torch and transformers. Paths are timed interleaved (round-robin, best of
``--repeats``), so a busy machine slows them alike. On CPU ``ragged_dot`` and ``dense`` do E/k
times the work (masked dense products) and run only where E <= 16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from zoo.deepseek_v3.moe import EXPERT_IMPLS, resolve_expert_impl, route
from zoo.runtime import RETAIN_HOST_MEMORY_ENV, retain_host_memory
from zoo.train import matmul_peak_flops

SHAPES = {  # tokens, width, experts, expert hidden, top-k, groups, groups kept
    "bench": (1024, 512, 16, 256, 2, 1, 1),
    "64e": (1024, 512, 64, 256, 8, 1, 1),
    "dsv3": (2048, 512, 256, 128, 8, 8, 4),
}
TORCH_PEER = Path(__file__).with_name("peer_transformers_moe.py")


def layer(t, d, e, m, k, groups, kept, dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((t, d)), dtype)
    router = jnp.asarray(rng.standard_normal((d, e)) * d**-0.5, jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.02, dtype) for s in [(e, d, m)] * 2 + [(e, m, d)]]
    routing = route(x, router, jnp.zeros(e), top_k=k, n_group=groups, topk_group=kept, norm_topk_prob=True, scaling=1.0)
    return x, ws, routing


def step_fn(impl):
    def loss(x, ws, routing):
        return jnp.sum(impl(x, routing, *ws).astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def interleaved(fns: dict, args: dict, repeats: int) -> dict:
    """Best-of-``repeats`` milliseconds of each function, run round-robin."""
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args[name]))  # compile + warm up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args[name]))
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: 1e3 * v for name, v in best.items()}


def transformers_ms(torch_python: str, x, ws, routing, repeats: int) -> float | str:
    """transformers' DeepseekV3Experts on the same rows, weights and routing (its own process)."""
    with tempfile.TemporaryDirectory() as tmp:
        arrays = {"x": x, "w_gate": ws[0], "w_up": ws[1], "w_down": ws[2], "experts": routing.experts, "weights": routing.weights}
        np.savez(Path(tmp) / "layer.npz", **{n: np.asarray(a, np.float32 if a.dtype != jnp.int32 else np.int64) for n, a in arrays.items()})
        spec = json.dumps({"npz": str(Path(tmp) / "layer.npz"), "repeats": repeats})
        env = {**os.environ, **RETAIN_HOST_MEMORY_ENV}  # the allocator settings zoo runs under
        out = subprocess.run([torch_python, str(TORCH_PEER), spec], capture_output=True, text=True, timeout=1800, check=False, env=env)
    if out.returncode:
        return f"missing ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode})"
    return json.loads(out.stdout.strip().splitlines()[-1])["ms"]


def bench(shape: str, impls: list[str], dtype, repeats: int, torch_python: str | None) -> dict:
    t, d, e, m, k, groups, kept = SHAPES[shape]
    x, ws, routing = layer(t, d, e, m, k, groups, kept, dtype)
    # On CPU ragged_dot and dense are masked dense products, E/k times the work: small E only.
    run = [i for i in impls if i not in ("ragged_dot", "dense") or e <= 16 or jax.default_backend() != "cpu"]
    fns = {name: step_fn(EXPERT_IMPLS[name]) for name in run}
    args = dict.fromkeys(run, (x, ws, routing))
    default = resolve_expert_impl("auto")
    # Dispatch alone: the default path with no expert hidden units (every matmul empty).
    fns["dispatch"] = step_fn(EXPERT_IMPLS[default])
    args["dispatch"] = (x, [w[..., :0] if i < 2 else w[:, :0] for i, w in enumerate(ws)], routing)
    # Same numbers first: the benchmark compares equal work products.
    values = {name: float(fns[name](*args[name])[0]) for name in run}
    for name, value in values.items():
        np.testing.assert_allclose(value, values[run[0]], rtol=2e-2 if dtype == jnp.bfloat16 else 1e-3, err_msg=name)
    ms = interleaved(fns, args, repeats)
    sizes = np.bincount(np.asarray(routing.experts).reshape(-1), minlength=e)
    row = {"shape": f"{shape}: T={t} D={d} E={e} M={m} top-{k}", "rows/expert": f"{sizes.min()}-{sizes.max()} (mean {t * k / e:.0f})",
           "default": default, **ms, "flops": 18 * t * k * d * m}  # fmt: skip
    if torch_python:
        row["transformers"] = transformers_ms(torch_python, x, ws, routing, repeats)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="bench,64e,dsv3", help=f"comma-separated, of {list(SHAPES)}")
    p.add_argument("--impls", default=",".join(EXPERT_IMPLS), help=f"comma-separated, of {list(EXPERT_IMPLS)}")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--torch-python", default=None, help="interpreter with torch + transformers (its experts, same run)")
    # Earlier flags, kept working: --bench-shape adds the bench shape to the 64-expert one.
    p.add_argument("--bench-shape", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--experts", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--top-k", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    retain_host_memory()  # before the first computation: as zoo's recipes run (docs/training.md)
    shapes = a.shapes.split(",")
    if a.experts is not None:  # the old quick form: --experts 16 --top-k 2 is the bench shape
        shapes = ["bench" if (a.experts, a.top_k) == (16, 2) else "64e"]
    unknown = [s for s in shapes if s not in SHAPES] + [i for i in a.impls.split(",") if i not in EXPERT_IMPLS]
    if unknown:
        p.error(f"unknown shape or path {unknown}: shapes {list(SHAPES)}, paths {list(EXPERT_IMPLS)}")
    dtype = jnp.dtype(a.dtype)
    peak = max(matmul_peak_flops(dtype), 1.0)
    rows = [bench(s, a.impls.split(","), dtype, a.repeats, a.torch_python) for s in shapes]
    peak = max(peak, matmul_peak_flops(dtype))  # the best of a measurement before and after
    impls = [i for i in a.impls.split(",") if any(i in r for r in rows)]
    print(f"MoE routed experts, forward + backward, {jax.devices()[0].device_kind}, {a.dtype}, best of {a.repeats} "
          f"interleaved; matmul peak {peak / 1e9:.1f} GFLOP/s\n")  # fmt: skip
    head = [*(f"{i} (ms)" for i in impls), "default GFLOP/s (% peak)", "dispatch (ms)", "grouped / default"]
    head += ["transformers (ms)", "transformers / default"] if a.torch_python else []
    print("| shape | rows per expert | " + " | ".join(head) + " |")
    print("|---|---|" + "---:|" * len(head))
    for r in rows:
        best = r[r["default"]]
        cells = [f"{r[i]:.1f}" if i in r else "—" for i in impls]
        gflops = r["flops"] / best / 1e6
        cells += [f"{gflops:.1f} ({100 * gflops * 1e9 / peak:.0f}%)", f"{r['dispatch']:.1f}"]
        cells += [f"{r['grouped'] / best:.2f}x" if "grouped" in r else "—"]
        if a.torch_python:
            tr = r["transformers"]
            cells += [f"{tr:.1f}", f"{tr / best:.2f}x"] if isinstance(tr, float) else [tr, "—"]
        print(f"| {r['shape']} | {r['rows/expert']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
