"""The planner against published, measured training runs (zoo/plan/published.py).

    python benchmarks/published_runs.py            # ~1 minute on 2 CPU cores; prints the markdown table

Fits one bf16 matmul efficiency per hardware on the calibration half of the runs only (the
half is fixed in zoo/plan/published.py), then prices every comparable run with its hardware's
fitted efficiency through the planner's cost model (its mesh, global batch and the zoo map
nearest the published remat / offload policy) and compares predicted with published tokens per
second per device. The held-out half is the test: how many of its runs fall within 20%.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from zoo.plan import published  # noqa: E402
from zoo.hardware import HARDWARE  # noqa: E402

TPU = ("tpu-v5p", "tpu-v6e")


def main() -> int:
    start = time.time()
    models = {r: published.cost_model(r) for r in published.RUNS if r.comparable}
    fitted = published.calibrate(published.RUNS, models=models.__getitem__)
    print("fitted bf16 matmul efficiency (calibration half only):")
    for hw, e in sorted(fitted.items()):
        table = HARDWARE[hw].efficiency
        print(f"  {hw}: {e:.3f} (zoo.hardware: {table:.3f}{'' if abs(e - table) < 1e-9 else ', differs'})")
    print()
    print("| run | hardware | mesh | batch/device | seq | map | published tok/s/dev | predicted | ratio | half "
          "| zoo fits |")
    print("|---|---|---|---:|---:|---|---:|---:|---:|---|---|")
    held: list[tuple[published.Run, float]] = []
    for run in published.RUNS:
        if not run.comparable:
            print(f"| {run.name} | {run.hardware} | {run.policy} | {run.per_device_batch} | {run.seq_len} | – | "
                  f"{run.tokens_per_s:,.0f} | – | – | not comparable | – |")  # fmt: skip
            continue
        p = published.predict(run, fitted[run.hardware], models[run])
        if run.half == published.HELD_OUT:
            held.append((run, p.ratio))
        print(f"| {run.name} | {run.hardware} | `{run.mesh}` | {run.per_device_batch} | {run.seq_len} | "
              f"`{run.placement}` | {run.tokens_per_s:,.0f} | {p.tokens_per_s:,.0f} | {p.ratio:.2f} | {run.half} | "
              f"{'yes' if p.fits else 'no'} |")  # fmt: skip
    within = [(r, x) for r, x in held if abs(x - 1) <= 0.2]
    tpu = [r for r, _ in within if r.hardware in TPU]
    gpu = [r for r, _ in within if r.hardware not in TPU]
    print()
    n_tpu = sum(r.hardware in TPU for r, _ in held)
    print(f"held out within 20%: {len(within)} of {len(held)} (TPU {len(tpu)} of {n_tpu}, GPU {len(gpu)} of "
          f"{len(held) - n_tpu})")
    for r, x in held:
        if abs(x - 1) > 0.2:
            print(f"  miss: {r.name}: ratio {x:.2f}")
    print(f"({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
