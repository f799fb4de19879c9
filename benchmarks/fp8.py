"""FP8 training against bf16: the main job's validation loss after 300 steps, per recipe.

    python benchmarks/fp8.py [--steps 300] [--models llama,deepseek_v3] [--precisions none,...] [--seeds 0,1,2]
                             [--out FILE]

Each run is ``recipes/train.py`` on the embedded corpus (the README's main job) with
``--compute-dtype bfloat16`` and one ``--precision`` (none: the bf16 peer, in the same
invocation; then ``fp8_all``, ``mxfp8``, ``blockwise``, and DeepSeek-V3's own ``deepseek``),
same seed, same batches. It prints, per model, each run's final validation loss, the bf16 run's,
their ratio and the wall time. Issue 40's target: every FP8 run within 2% of bf16.

On CPU the FP8 recipes are emulated exactly (``zoo.layers.fp8``): the numbers are the recipes'
own; the times are not an FP8 GEMM's (the quantization runs as extra element-wise work).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "llama": ("none", "fp8_all", "mxfp8", "blockwise"),
    "deepseek_v3": ("none", "fp8_all", "mxfp8", "deepseek"),
}


def run(model: str, precision: str, steps: int, tmp: Path, seed: int = 0) -> tuple[float, float]:
    """``(final validation loss, seconds)`` of one main-job run."""
    run_dir = tmp / f"{model}-{precision}-{seed}"
    cmd = [sys.executable, str(ROOT / "recipes/train.py"), "--model", model, "--preset", "small", "--steps", str(steps),
           "--compute-dtype", "bfloat16", "--eval-every", str(steps), "--log-every", str(steps),
           "--checkpoint-every", str(10 * steps), "--run-dir", str(run_dir), "--seed", str(seed)]  # fmt: skip
    if precision != "none":
        cmd += ["--precision", precision]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if "val_loss" in r][-1], seconds


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--models", default="llama,deepseek_v3")
    p.add_argument("--precisions", default=None, help="comma-separated, 'none' (the peer) first; default each model's four")
    p.add_argument("--seeds", default="0", help="comma-separated --seed values (init and batches); each its own peer")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    rows = []
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            chosen = args.precisions.split(",") if args.precisions else RECIPES[model]
            if chosen[0] != "none":
                p.error(f"--precisions {args.precisions}: the peer 'none' must come first")
            for seed in seeds:
                base = None
                for precision in chosen:
                    loss, seconds = run(model, precision, args.steps, Path(tmp), seed)
                    base = loss if precision == "none" else base
                    rows.append({"model": model, "precision": precision, "seed": seed, "val_loss": loss, "bf16": base,
                                 "ratio": loss / base, "seconds": seconds})  # fmt: skip
                    print(rows[-1], flush=True)
    lines = [
        (f"The main job (`recipes/train.py --preset small`, embedded corpus, bf16 compute), {args.steps} steps, final "
         "validation loss per `--precision`; the peer is the bf16 run (`none`) of the same invocation and seed."),
        "",
        "| model | --precision | seed | validation loss | bf16 (peer) | ratio | within 2% | wall s |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        ok = "yes" if abs(r["ratio"] - 1) <= 0.02 else "NO"
        lines.append(f"| {r['model']} | {r['precision']} | {r['seed']} | {r['val_loss']:.4f} | {r['bf16']:.4f} | "
                     f"{r['ratio']:.4f} | {ok} | {r['seconds']:.0f} |")  # fmt: skip
    if len(seeds) > 1:
        lines += ["", "| model | --precision | mean ratio over seeds | min | max |", "|---|---|---:|---:|---:|"]
        for model in args.models.split(","):
            for precision in dict.fromkeys(r["precision"] for r in rows if r["model"] == model):
                ratios = [r["ratio"] for r in rows if r["model"] == model and r["precision"] == precision]
                lines.append(f"| {model} | {precision} | {sum(ratios) / len(ratios):.4f} | {min(ratios):.4f} | "
                             f"{max(ratios):.4f} |")  # fmt: skip
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
