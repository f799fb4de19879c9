"""The train step's matmuls, each timed alone: XLA (what zoo compiles to) against PyTorch.

    python benchmarks/matmuls.py [--model llama] [--platform cpu|gpu] [--torch-python PY] [--reps 10]

Why: on CPU zoo's step is matmul-bound, so how fast the two frameworks run *the same matmuls*
bounds how close zoo's step can come to transformers'. This takes every ``dot_general`` of zoo's
jitted train step (the jaxpr, forward and backward, scanned layers counted ``length`` times),
times each distinct one alone as that very ``dot_general`` (operand dtypes and accumulation type
included) under ``jax.jit`` and, under ``--torch-python``, the same contraction as
``torch.einsum`` on contiguous tensors of the same shapes (both in the left operand's dtype), and
prints per-dot and total milliseconds per step with their ratio. Medians of ``--reps`` calls after
two warm-up calls. Also the MFU ceiling: the model's FLOPs per step (``flops_per_token``) over the
matmuls' total time, as a share of the matmul peak measured in the same run (best of before and
after), i.e. the MFU of a step that did nothing but these matmuls, each as fast as alone.

Alone is not inside the step: XLA fuses and re-lays out some dots in the step (the multi-
dimensional projection einsums run faster there than alone), so the total is what the same
contractions cost each framework's matmul kernels, not a floor on either step. Attention through
cuDNN's fused kernel (GPU, half precision) is not a ``dot_general``: the table says how many such
calls it leaves out.

Every registered family's bench preset (``--model``). A dot inside a ``while`` loop or a ``cond``
runs a number of times that follows the data (the MoE ``capacity`` kernel's overflow path, which
runs only when an expert receives more rows than its capacity): such dots are listed, not
counted, so for the MoE families the total leaves out the overflow's matmuls, when there are any.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import string
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def einsum_spec(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> str:
    """The einsum string of a ``dot_general`` (output: batch, lhs free, rhs free — XLA's order)."""
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter(string.ascii_lowercase)
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
    """2 x the product of every dimension's size (each letter once): a dot's multiply-adds x 2."""
    sizes = dict(zip(spec.split(",")[0], lhs)) | dict(zip(spec.split(",")[1].split("-")[0], rhs))
    n = 2
    for v in sizes.values():
        n *= v
    return n


def step_dots(model: str, platform: str) -> tuple[list[dict], int, list[str]]:
    """Every distinct dot of zoo's train step (shapes, dimension numbers, dtypes, einsum spec,
    calls per step), the number of fused-attention calls, which are not dots, and the einsum
    specs of the dots whose calls follow the data (inside a ``while`` or ``cond``)."""
    import jax
    import jax.numpy as jnp
    from train_step import zoo_setup

    step, params, opt_state, batch, _ = zoo_setup(model, platform)
    jaxpr = jax.make_jaxpr(step)(params, opt_state, batch, jnp.int32(0))
    counts: collections.Counter = collections.Counter()
    data_dependent: collections.Counter = collections.Counter()
    fused_attention = 0

    def walk(j, times: int | None, where: str) -> None:
        nonlocal fused_attention
        for eqn in j.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                lhs, rhs = (v.aval for v in eqn.invars)
                if times is None:  # inside a while loop or a cond: no static count
                    spec = einsum_spec(lhs.ndim, rhs.ndim, eqn.params["dimension_numbers"])
                    data_dependent[f"`{spec}` {list(lhs.shape)} x {list(rhs.shape)} (in a {where})"] += 1
                    continue
                dn = eqn.params["dimension_numbers"]
                pref = eqn.params.get("preferred_element_type") or eqn.outvars[0].aval.dtype
                key = (tuple(lhs.shape), tuple(rhs.shape), tuple(eqn.outvars[0].aval.shape),
                       json.dumps([[list(d) for d in pair] for pair in dn]),
                       str(lhs.dtype), str(rhs.dtype), str(jnp.dtype(pref)))  # fmt: skip
                counts[key] += times
            elif "dot_product_attention" in name and times is not None:
                fused_attention += times
            inner, inner_where = times, where
            if name == "scan" and times is not None:
                inner = times * eqn.params["length"]
            elif name in ("while", "cond"):
                inner, inner_where = None, name
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
                        walk(sub.jaxpr, inner, inner_where)
                    elif hasattr(sub, "eqns"):
                        walk(sub, inner, inner_where)

    walk(jaxpr.jaxpr, 1, "")
    dots = []
    for (lhs, rhs, out, dn, lhs_dtype, rhs_dtype, pref), n in counts.items():
        spec = einsum_spec(len(lhs), len(rhs), json.loads(dn))
        dots.append({"lhs": list(lhs), "rhs": list(rhs), "out": list(out), "dimension_numbers": json.loads(dn),
                     "spec": spec, "lhs_dtype": lhs_dtype, "rhs_dtype": rhs_dtype, "accumulate": pref,
                     "count": n, "gflop": n * flops(list(lhs), list(rhs), spec) / 1e9})  # fmt: skip
    return dots, fused_attention, [f"{k} x{n}" for k, n in data_dependent.items()]


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
    """Each dot alone: the step's very ``dot_general`` (dimension numbers, dtypes, accumulation)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for d in dots:
        a = jnp.asarray(rng.standard_normal(d["lhs"]), d["lhs_dtype"])
        b = jnp.asarray(rng.standard_normal(d["rhs"]), d["rhs_dtype"])
        dn = tuple(tuple(tuple(x) for x in pair) for pair in d["dimension_numbers"])
        f = jax.jit(lambda a, b, dn=dn, acc=d["accumulate"]: jax.lax.dot_general(a, b, dn, preferred_element_type=acc))
        if list(f(a, b).shape) != d["out"] or list(jnp.einsum(d["spec"], a, b).shape) != d["out"]:
            raise AssertionError(f"{d['spec']}: not the step's dot (output {d['out']})")
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
        dtype = dtypes[d["lhs_dtype"]]  # einsum wants one dtype: the left operand's
        a = torch.randn(d["lhs"], generator=gen).to(device, dtype)
        b = torch.randn(d["rhs"], generator=gen).to(device, dtype)

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
    from train_step import BATCH, SEQ, default_torch_python, peak_flops, zoo_config

    dots, fused_attention, data_dependent = step_dots(args.model, args.platform)
    dtype = "bfloat16" if args.platform == "gpu" else "float32"
    peak = peak_flops(args.platform, (dtype,))[dtype]
    xla_ms = time_xla(dots, args.reps)
    peak = max(peak, peak_flops(args.platform, (dtype,))[dtype])  # the best of before and after, as train_step.py
    peer = time_torch(dots, args.torch_python or default_torch_python(), args.reps, args.platform)
    torch_ms = peer.get("ms") or [None] * len(dots)
    if len(torch_ms) != len(dots):
        peer, torch_ms = {"missing": f"torch timed {len(torch_ms)} of {len(dots)} dots"}, [None] * len(dots)
    for d, x, t in zip(dots, xla_ms, torch_ms):
        d["xla_ms"], d["torch_ms"] = x, t
    model_flops = BATCH * SEQ * zoo_config(args.model).flops_per_token(SEQ)
    return {"model": args.model, "platform": args.platform, "dots": dots, "fused_attention_calls": fused_attention,
            "data_dependent": data_dependent, "model_flops_per_step": model_flops, "peak_flops": peak,
            "peak_dtype": dtype, "torch": {k: v for k, v in peer.items() if k != "ms"}}  # fmt: skip


def table(r: dict) -> str:
    dots = sorted(r["dots"], key=lambda d: -d["gflop"])
    has_torch = all(d["torch_ms"] is not None for d in dots)
    lines = [f"Every matmul of zoo's {r['model']} train step (bench shape), each timed alone, ms per step "
             "(one call's median x calls per step). ratio = XLA / PyTorch (> 1: XLA slower). "
             + (f"PyTorch {r['torch'].get('torch')}, {r['torch'].get('threads')} threads."
                if has_torch else f"PyTorch: missing ({r['torch'].get('missing')}).")
             + (f" Not counted: {r['fused_attention_calls']} fused-attention calls (cuDNN), which are not dots."
                if r["fused_attention_calls"] else ""), "",
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
    if r.get("model_flops_per_step"):
        # If the step did nothing but these matmuls, each as fast as alone: its MFU.
        mf, peak = r["model_flops_per_step"], r["peak_flops"]
        ceiling = f"{100 * mf / (x / 1e3) / peak:.1f}% with XLA's kernels"
        if has_torch:
            ceiling += f", {100 * mf / (t / 1e3) / peak:.1f}% with PyTorch's"
        lines += ["", (f"MFU ceiling: the model's {mf / 1e9:.1f} GFLOP a step (`flops_per_token`) over these matmuls' "
                       f"total time, against the {r['peak_dtype']} matmul peak measured in this run "
                       f"({peak / 1e9:.1f} GFLOP/s): {ceiling}. A step that did nothing else, its matmuls as fast as "
                       "alone, would reach it; the real step also norms, rotates, routes, updates the weights and so on.")]
    if r.get("data_dependent"):
        lines += ["", "Not counted (calls per step follow the routing; none run when no expert overflows its "
                  "capacity): " + "; ".join(r["data_dependent"]) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from placement import setup_platform
    from train_step import MODELS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=MODELS, help="whose bench preset's train step")
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--torch-python", default=None, help="interpreter with torch (default: this one, if it has torch and transformers)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per dot (median)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
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
