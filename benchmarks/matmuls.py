"""The train step's matmuls, each timed alone: XLA (what zoo compiles to) against PyTorch.

    python benchmarks/matmuls.py [--model llama] [--platform cpu|gpu] [--torch-python PY] [--reps 10]

Why: on CPU zoo's step is matmul-bound, so how fast the two frameworks run *the same matmuls*
bounds how close zoo's step can come to transformers'. This takes every ``dot_general`` of zoo's
jitted train step (the jaxpr, forward and backward, scanned layers counted ``length`` times),
times each distinct one alone under ``jax.jit`` and, under ``--torch-python``, the same
contraction as ``torch.einsum`` on contiguous tensors of the same shapes, and prints per-dot and
total milliseconds per step with their ratio. Medians of ``--reps`` calls after two warm-up calls.

Only models whose dots all have a static count (no data-dependent loop) are supported: Llama.
DeepSeek-V3's expert kernel runs a loop whose trip count follows the routing.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def einsum_spec(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> str:
    """The einsum string of a ``dot_general`` (output: batch, lhs free, rhs free — XLA's order)."""
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter(LETTERS)
    lhs = [""] * lhs_ndim
    rhs = [""] * rhs_ndim
    for i, j in zip(lb, rb):
        lhs[i] = rhs[j] = next(letters)
    for i, j in zip(lc, rc):
        lhs[i] = rhs[j] = next(letters)
    for dims in (lhs, rhs):
        for i, d in enumerate(dims):
            if not d:
                dims[i] = next(letters)
    out = [lhs[i] for i in lb] + [lhs[i] for i in range(lhs_ndim) if i not in (*lb, *lc)]
    out += [rhs[i] for i in range(rhs_ndim) if i not in (*rb, *rc)]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"


def flops(lhs: list[int], rhs: list[int], spec: str) -> int:
    sizes = dict(zip(spec.split(",")[0], lhs)) | dict(zip(spec.split(",")[1].split("-")[0], rhs))
    n = 2
    for v in sizes.values():
        n *= v
    return n


def step_dots(model: str, platform: str) -> list[dict]:
    """Every distinct dot of zoo's train step: shapes, einsum spec, dtype and calls per step."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(HERE))
    from train_step import zoo_setup

    step, params, opt_state, batch, _ = zoo_setup(model, platform)
    jaxpr = jax.make_jaxpr(step)(params, opt_state, batch, jnp.int32(0))
    counts: collections.Counter = collections.Counter()

    def walk(j, times: int) -> None:
        for eqn in j.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                lhs, rhs = (v.aval for v in eqn.invars)
                spec = einsum_spec(lhs.ndim, rhs.ndim, eqn.params["dimension_numbers"])
                out = tuple(eqn.outvars[0].aval.shape)
                counts[(tuple(lhs.shape), tuple(rhs.shape), out, spec, str(lhs.dtype))] += times
            if name == "while":
                raise SystemExit(f"{model}'s step has a data-dependent loop: its dots have no static count")
            inner = times * (eqn.params["length"] if name == "scan" else 1)
            for p in eqn.params.values():
                for q in p if isinstance(p, (list, tuple)) else [p]:
                    if hasattr(q, "jaxpr") and hasattr(q, "consts"):
                        walk(q.jaxpr, inner)
                    elif hasattr(q, "eqns"):
                        walk(q, inner)

    walk(jaxpr.jaxpr, 1)
    return [{"lhs": list(lhs), "rhs": list(rhs), "out": list(out), "spec": spec, "dtype": dtype, "count": n,
             "gflop": n * flops(list(lhs), list(rhs), spec) / 1e9}
            for (lhs, rhs, out, spec, dtype), n in counts.items()]  # fmt: skip


def median_ms(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def time_xla(dots: list[dict], reps: int) -> list[float]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for d in dots:
        a = jnp.asarray(rng.standard_normal(d["lhs"]), d["dtype"])
        b = jnp.asarray(rng.standard_normal(d["rhs"]), d["dtype"])
        f = jax.jit(lambda a, b, spec=d["spec"]: jnp.einsum(spec, a, b))
        if list(f(a, b).shape) != d["out"]:  # the spec must be the step's very contraction
            raise AssertionError(f"{d['spec']} gives {f(a, b).shape}, the step's dot gives {d['out']}")
        out.append(median_ms(lambda f=f, a=a, b=b: f(a, b).block_until_ready(), reps))
    return out


def time_torch_main(spec_json: str) -> None:
    """Under the peer's interpreter: imports torch only; prints one JSON line of milliseconds."""
    import torch

    spec = json.loads(spec_json)
    device = spec.get("device", "cpu")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    gen = torch.Generator().manual_seed(0)
    ms = []
    for d in spec["dots"]:
        a = torch.randn(d["lhs"], generator=gen).to(device, dtypes[d["dtype"]])
        b = torch.randn(d["rhs"], generator=gen).to(device, dtypes[d["dtype"]])

        def call(a=a, b=b, s=d["spec"]):
            torch.einsum(s, a, b)
            if device == "cuda":
                torch.cuda.synchronize()

        with torch.no_grad():
            ms.append(median_ms(call, spec["reps"]))
    print(json.dumps({"ms": ms, "threads": torch.get_num_threads(), "torch": torch.__version__}))


def time_torch(dots: list[dict], python: str | None, reps: int, platform: str) -> dict:
    from train_step import run_peer

    if python is None:
        return {"missing": "torch not installed here (give --torch-python)"}
    spec = {"dots": dots, "reps": reps, "device": "cuda" if platform == "gpu" else "cpu"}
    return run_peer(python, "matmuls.py", spec, 1800, "torch matmuls")


def run(args: argparse.Namespace) -> dict:
    from train_step import default_torch_python

    dots = step_dots(args.model, args.platform)
    xla = time_xla(dots, args.reps)
    torch = time_torch(dots, args.torch_python or default_torch_python(), args.reps, args.platform)
    for d, x in zip(dots, xla):
        d["xla_ms"] = x
    for d, t in zip(dots, torch.get("ms", [None] * len(dots))):
        d["torch_ms"] = t
    return {"model": args.model, "platform": args.platform, "dots": dots,
            "torch": {k: v for k, v in torch.items() if k != "ms"}}  # fmt: skip


def table(r: dict) -> str:
    dots = sorted(r["dots"], key=lambda d: -d["gflop"])
    has_torch = all(d["torch_ms"] is not None for d in dots)
    lines = [f"Every matmul of zoo's {r['model']} train step (bench shape), each timed alone, ms per step "
             "(one call's median x calls per step). ratio = XLA / PyTorch (> 1: XLA slower)."
             + ("" if has_torch else f" PyTorch: missing ({r['torch'].get('missing')})."), "",
             "| einsum | lhs | rhs | calls | GFLOP | XLA ms | XLA GFLOP/s | PyTorch ms | PyTorch GFLOP/s | ratio |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for d in dots:
        x = d["xla_ms"] * d["count"]
        row = f"| `{d['spec']}` | {d['lhs']} | {d['rhs']} | {d['count']} | {d['gflop']:.2f} | {x:.1f} | {d['gflop'] / x * 1e3:.0f}"
        if has_torch:
            t = d["torch_ms"] * d["count"]
            row += f" | {t:.1f} | {d['gflop'] / t * 1e3:.0f} | {x / t:.2f}x |"
        else:
            row += " | - | - | - |"
        lines.append(row)
    gf = sum(d["gflop"] for d in dots)
    x = sum(d["xla_ms"] * d["count"] for d in dots)
    row = f"| **all** | | | {sum(d['count'] for d in dots)} | {gf:.1f} | **{x:.0f}** | {gf / x * 1e3:.0f}"
    if has_torch:
        t = sum(d["torch_ms"] * d["count"] for d in dots)
        row += f" | **{t:.0f}** | {gf / t * 1e3:.0f} | **{x / t:.2f}x** |"
    else:
        row += " | - | - | - |"
    lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=["llama"])
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--torch-python", default=None, help="interpreter with torch (default: this one, if it has it)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per dot (median)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from placement import setup_platform

    setup_platform(args.platform)
    r = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    print(table(r))
    return r


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        time_torch_main(sys.argv[1])  # the peer side, under --torch-python
    else:
        main()
