"""Training-step speed: zoo against transformers (PyTorch) and MaxText; MFU; compile time vs depth.

    python benchmarks/train_step.py [--platform cpu|gpu] [--models llama,deepseek_v3]
                                    [--torch-python PY] [--maxtext-python PY] [--steps 5] [--warmup 2]
                                    [--depths 2,8,32] [--json out.json]

The bench shape, the same in every peer: batch 4 x sequence 256, d_model 512, 4 layers, 8 query
heads of 64, MLP 1536, vocab 8192, AdamW (global-norm clipping 1.0), float32 parameters; float32
compute on CPU, bf16 compute with ``--platform gpu``. Llama: 4 KV heads
(``zoo.llama.preset("bench")``). DeepSeek-V3: 1 dense layer then 3 MoE layers, 16 routed experts
top-2, no group limit, expert MLP 256, one shared expert, MLA q_lora 128 / kv_lora 64, qk_nope 64,
qk_rope 32, v 64 (``zoo.deepseek_v3.preset("bench")``).

- zoo: ``zoo.train.make_train_step`` + ``zoo.train.optimizer``, random init, synthetic tokens;
  the median wall time of ``--steps`` steps after ``--warmup``.
- transformers: ``LlamaForCausalLM`` / ``DeepseekV3ForCausalLM`` from the same config
  (``config.to_hf()``), ``torch.optim.AdamW``, run by ``benchmarks/peer_transformers.py`` under
  ``--torch-python`` (default: this interpreter if it has torch).
- MaxText: its own trainer on synthetic data, run by ``benchmarks/peer_maxtext.py`` under
  ``--maxtext-python`` (default: ``benchmarks/.venv-maxtext``, made by
  ``benchmarks/maxtext_setup.sh``).

A peer that is not installed or fails is reported as ``missing (reason)``, never skipped.
``ratio`` is zoo's step time over the peer's (< 1: zoo is faster).

MFU: zoo's model FLOP/s (tokens/s x ``config.flops_per_token(seq)``) over the machine's matmul
peak, measured in the same run by ``zoo.train.matmul_peak_flops`` (float32 and bf16).

Compile time vs depth: lower + compile of zoo's whole train step for the Llama bench shape at
each of ``--depths`` layers (the layers are scanned, so it should barely grow).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from placement import setup_platform  # noqa: E402  (the GPU XLA flags the placement benchmark documents)

BATCH, SEQ = 4, 256
MODELS = ("llama", "deepseek_v3", "qwen3", "qwen3_moe")  # any registered model type's bench preset
DEFAULT_MODELS = ("llama", "deepseek_v3")
MAXTEXT_VENV = HERE / ".venv-maxtext"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--steps", type=int, default=5, help="timed steps (median) after the warm-up")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    p.add_argument("--torch-python", default=None, help="interpreter with torch + transformers (default: this one)")
    p.add_argument("--maxtext-python", default=None, help=f"MaxText's interpreter (default: {MAXTEXT_VENV}/bin/python)")
    p.add_argument("--peers", default="transformers,maxtext", help="comma-separated peers to run ('' for none)")
    p.add_argument("--expert-impl", default="auto", help="zoo's expert path for the MoE models (zoo.layers.moe)")
    p.add_argument("--torch-experts", default=None, help="transformers experts_implementation (default: its own)")
    p.add_argument("--depths", default="2,8,32", help="Llama depths for the compile-time table ('' to skip)")
    p.add_argument("--peer-timeout", type=int, default=1800, help="seconds before a peer run counts as failed")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    return p.parse_args(argv)


# -- zoo -----------------------------------------------------------------------------------------
def zoo_config(name: str, num_layers: int | None = None):
    """The ``bench`` preset of model type ``name`` (any registered one)."""
    import dataclasses

    from zoo.core import registry

    config = registry.by_model_type(name).config_cls.preset("bench", name)
    return config if num_layers is None else dataclasses.replace(config, num_layers=num_layers)


def zoo_setup(name: str, platform: str, num_layers: int | None = None, expert_impl: str = "auto"):
    """(step, params, opt_state, batch, config): zoo's jitted train step and its inputs
    (``expert_impl``: the MoE families' expert path)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import zoo
    from zoo import train as ztrain

    config = zoo_config(name, num_layers)
    cls = zoo.registry.by_model_type(name)
    compute = jnp.bfloat16 if platform == "gpu" else jnp.float32
    extra = {"expert_impl": expert_impl} if "expert_impl" in inspect.signature(cls.__init__).parameters else {}
    model = cls(config, key=jax.random.key(0), compute_dtype=compute, **extra)
    cfg = ztrain.TrainConfig(steps=1000, batch_size=BATCH, seq_len=SEQ, warmup=10)
    tx = ztrain.optimizer(cfg, model)
    step = ztrain.make_train_step(model, cfg, tx)
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, config.vocab_size, (1, BATCH, SEQ)), jnp.int32)
    return step, params, opt_state, batch, config


def zoo_step_time(name: str, platform: str, steps: int, warmup: int, expert_impl: str = "auto") -> dict:
    import jax
    import jax.numpy as jnp

    step, params, opt_state, batch, config = zoo_setup(name, platform, expert_impl=expert_impl)
    t = time.perf_counter()
    compiled = step.lower(params, opt_state, batch, jnp.int32(0)).compile()
    compile_s = time.perf_counter() - t
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        params, opt_state, metrics = compiled(params, opt_state, batch, jnp.int32(i))
        jax.block_until_ready(metrics["loss"])
        if i >= warmup:
            times.append(time.perf_counter() - t)
    ms = 1e3 * statistics.median(times)
    flops = config.flops_per_token(SEQ)
    return {
        "ms": ms,
        "times_ms": [1e3 * x for x in times],
        "tokens_per_s": BATCH * SEQ / (ms / 1e3),
        "flops_per_token": flops,
        "model_flops_per_s": BATCH * SEQ * flops / (ms / 1e3),
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "num_params": config.num_params(),
    }


def peak_flops(platform: str, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict[str, float]:
    """The machine's matmul peak (FLOP/s) in each of ``dtypes``, measured now."""
    import jax.numpy as jnp

    from zoo.train import matmul_peak_flops

    n = 8192 if platform == "gpu" else 2048
    return {d: matmul_peak_flops(jnp.dtype(d), n=n) for d in dtypes}


def compile_vs_depth(depths: list[int], platform: str) -> list[dict]:
    """Lower + compile time of the Llama bench train step at each depth (a throwaway compile first)."""
    import jax
    import jax.numpy as jnp

    rows = []
    for i, layers in enumerate([depths[0], *depths]):
        step, params, opt_state, batch, _ = zoo_setup("llama", platform, num_layers=layers)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, opt_state))
        del params, opt_state
        t0 = time.perf_counter()
        lowered = step.lower(*abstract, batch, jnp.int32(0))
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        if i:  # the first compile warms JAX's own caches: not counted
            rows.append({"layers": layers, "lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0})
    return rows


# -- peers ---------------------------------------------------------------------------------------
def run_peer(python: str | None, script: str, spec: dict, timeout: int, what: str) -> dict:
    """One JSON line from ``python script spec``, or ``{"missing": reason}``."""
    if python is None:
        return {"missing": f"no interpreter for {what}"}
    if not (Path(python).exists() or shutil.which(python)):
        return {"missing": f"{python} not found"}
    try:
        from zoo.runtime import RETAIN_HOST_MEMORY_ENV

        # The peers get the allocator settings zoo's process runs under, so the comparison
        # measures the frameworks, not glibc's defaults.
        env = {**os.environ, **RETAIN_HOST_MEMORY_ENV}
        proc = subprocess.run(
            [python, str(HERE / script), json.dumps(spec)], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"missing": f"{what} timed out after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1][-300:]
        return {"missing": f"{what} failed (rc {proc.returncode}): {err}"}
    return json.loads(lines[-1])


def default_torch_python() -> str | None:
    import importlib.util

    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        return sys.executable
    return None


def torch_peer(name: str, args: argparse.Namespace) -> dict:
    python = args.torch_python or default_torch_python()
    if python is None:
        return {"missing": "torch/transformers not installed here (give --torch-python)"}
    spec = {
        "hf_config": zoo_config(name).to_hf(),
        "batch": BATCH,
        "seq": SEQ,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": "cuda" if args.platform == "gpu" else "cpu",
        "bf16": args.platform == "gpu",
        "experts": args.torch_experts,
    }
    return run_peer(python, "peer_transformers.py", spec, args.peer_timeout, "transformers")


def maxtext_python(args: argparse.Namespace) -> str | None:
    if args.maxtext_python:
        return args.maxtext_python
    py = MAXTEXT_VENV / "bin" / "python"
    return str(py) if py.exists() else None


def maxtext_peer(name: str, args: argparse.Namespace) -> dict:
    if name not in ("llama", "deepseek_v3"):
        return {"missing": f"peer_maxtext.py configures MaxText's llama2 and deepseek blocks only, not {name}"}
    python = maxtext_python(args)
    if python is None:
        return {"missing": f"not installed (run benchmarks/maxtext_setup.sh; {maxtext_unavailable_reason()})"}
    spec = {"model": name, "batch": BATCH, "seq": SEQ, "steps": args.steps, "warmup": args.warmup,
            "platform": args.platform, "bf16": args.platform == "gpu", "timeout": args.peer_timeout}  # fmt: skip
    return run_peer(python, "peer_maxtext.py", spec, args.peer_timeout + 60, "MaxText")


def maxtext_unavailable_reason() -> str:
    """Why the setup script would not find what MaxText needs (checked cheaply, no network)."""
    for c in (os.environ.get("PYTHON312"), shutil.which("python3.12")):
        if c and subprocess.run([c, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                capture_output=True).returncode == 0:  # fmt: skip
            return "Python 3.12 found"
    pyenv = shutil.which("pyenv")
    if pyenv:
        out = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True).stdout.split()
        if any(v.startswith("3.12") for v in out):
            return "Python 3.12 found in pyenv"
    return "MaxText needs Python 3.12, which this machine lacks"


# -- report --------------------------------------------------------------------------------------
def versions(results: dict) -> dict[str, str]:
    import jax

    out = {"jax": jax.__version__, "maxtext": "missing", "torch": "missing", "transformers": "missing"}
    for model in results["models"].values():
        for peer in ("transformers", "maxtext"):
            out.update(model.get(peer, {}).get("versions", {}))
    return out


def fmt_peer(r: dict, zoo_ms: float) -> tuple[str, str]:
    if "ms" not in r:
        return f"missing ({r['missing']})", "-"
    return f"{r['ms']:.0f}", f"{zoo_ms / r['ms']:.2f}x"


def tables(results: dict) -> str:
    """The markdown tables of one run."""
    lines = []
    plat = results["platform"]
    dtype = "bf16 compute, float32 parameters" if plat == "gpu" else "float32"
    lines.append(f"Train step, batch {BATCH} x seq {SEQ}, AdamW, {dtype}, {results['device']}; "
                 f"median of {results['steps']} steps after {results['warmup']} warm-up. "
                 "ratio = zoo's time / the peer's (< 1: zoo faster).\n")  # fmt: skip
    lines.append("| model | zoo ms/step | zoo tokens/s | transformers ms/step | zoo / transformers "
                 "| MaxText ms/step | zoo / MaxText | zoo compile s |")  # fmt: skip
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results["models"].items():
        z = r["zoo"]
        t_ms, t_ratio = fmt_peer(r["transformers"], z["ms"])
        m_ms, m_ratio = fmt_peer(r["maxtext"], z["ms"])
        lines.append(f"| {name} | {z['ms']:.0f} | {z['tokens_per_s']:.0f} | {t_ms} | {t_ratio} | {m_ms} | {m_ratio} "
                     f"| {z['compile_s']:.1f} |")  # fmt: skip
    peak = results["peak_flops"]
    lines.append("")
    ref = "bfloat16" if plat == "gpu" else "float32"
    lines.append(f"MFU: zoo's model FLOP/s over the matmul peak measured in this run "
                 f"(float32 {peak['float32'] / 1e9:.1f} GFLOP/s, bf16 {peak['bfloat16'] / 1e9:.1f} GFLOP/s); "
                 f"the {ref} peak is the reference.\n")  # fmt: skip
    lines.append("| model | FLOPs/token | model GFLOP/s | MFU vs float32 peak | MFU vs bf16 peak |")
    lines.append("|---|---:|---:|---:|---:|")
    for name, r in results["models"].items():
        z = r["zoo"]
        f = z["model_flops_per_s"]
        lines.append(f"| {name} | {z['flops_per_token'] / 1e6:.1f} M | {f / 1e9:.1f} "
                     f"| {f / peak['float32']:.1%} | {f / peak['bfloat16']:.1%} |")  # fmt: skip
    if results.get("compile"):
        rows = results["compile"]
        lines.append("")
        lines.append("Compile time of the Llama bench train step vs depth (lower + XLA compile, seconds):\n")
        lines.append("| layers | lower s | compile s | total s | vs fewest layers |")
        lines.append("|---:|---:|---:|---:|---:|")
        for r in rows:
            lines.append(f"| {r['layers']} | {r['lower_s']:.2f} | {r['compile_s']:.2f} | {r['total_s']:.2f} "
                         f"| {r['total_s'] / rows[0]['total_s']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace, save=lambda results: None) -> dict:
    """Every figure of the benchmark, as a dict (also what run_all.py consumes); ``save`` gets
    the results so far after each model and at the end (a run cut short keeps what it has)."""
    import jax

    peers = [p for p in args.peers.split(",") if p]
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {MODELS}")
    dev = jax.devices()[0]
    device = f"{dev.platform} ({dev.device_kind}, {os.cpu_count()} cores)" if dev.platform == "cpu" else dev.device_kind
    results = {"platform": args.platform, "device": device, "steps": args.steps, "warmup": args.warmup, "models": {}}
    results["peak_flops"] = peak_flops(args.platform)
    for name in models:
        print(f"  zoo {name} ...", file=sys.stderr, flush=True)
        r = {"zoo": zoo_step_time(name, args.platform, args.steps, args.warmup, args.expert_impl)}
        for peer, fn in (("transformers", torch_peer), ("maxtext", maxtext_peer)):
            if peer in peers:
                print(f"  {peer} {name} ...", file=sys.stderr, flush=True)
                r[peer] = fn(name, args)
            else:
                r[peer] = {"missing": "not run (--peers)"}
        results["models"][name] = r
        results["versions"] = versions(results)
        save(results)
    # The peak once more after the models: contention changes over a run; keep the best.
    again = peak_flops(args.platform)
    results["peak_flops"] = {k: max(v, again[k]) for k, v in results["peak_flops"].items()}
    depths = [int(d) for d in args.depths.split(",") if d]
    if depths:
        print(f"  compile time at {depths} layers ...", file=sys.stderr, flush=True)
        results["compile"] = compile_vs_depth(depths, args.platform)
    results["versions"] = versions(results)
    save(results)
    return results


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup_platform(args.platform)
    save = (lambda r: Path(args.json).write_text(json.dumps(r, indent=1))) if args.json else (lambda r: None)
    results = run(args, save)
    print(tables(results))
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()))
    return results


if __name__ == "__main__":
    main()
