"""Report a run's profile (``recipes/train.py --profile START:STOP``): per step the wall time, the
device's compute and collectives, host<->device copies each way (count, MB, achieved GB/s) and
how much copy time compute hid versus how much was exposed; then time by region (decoder layers
forward and backward, the rest, the update), time by named tensor (the ops under each named
tensor's scope: forward, recomputed, backward) and the top ops with their source.

    python recipes/train.py --steps 6 --profile 3:5 --run-dir runs/p
    python recipes/profile.py runs/p

What the figures mean: docs/placement.md, "Reading the profile".
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zoo.cli import Help


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("run_dir", help="a run dir holding profile/ (written by recipes/train.py --profile)")
    p.add_argument("--top", type=int, default=15, help="how many ops to list (default 15)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from zoo.train import trace_report

    run_dir = Path(args.run_dir)
    try:  # a run dir that is a file, a damaged step.json or trace: one line naming it
        traces = trace_report.find_traces(run_dir)
        if not traces:
            parser().error(f"{run_dir / 'profile'} holds no trace (*.xplane.pb): record one with recipes/train.py "
                           f"--run-dir {run_dir} --profile START:STOP")  # fmt: skip
        folder = run_dir / "profile"
        info = trace_report.read_step_info(folder)
        hlo = folder / "step.hlo.txt"
        sources = trace_report.hlo_sources(hlo.read_text()) if hlo.is_file() else {}
        reports = [(path, trace_report.analyse(trace_report.read_events(path), sources)) for path in traces]
    except (trace_report.ProfileError, OSError, UnicodeDecodeError) as e:
        parser().error(str(e))
    print(f"profile: {traces[0].parent}")
    if info:
        memory = info.get("memory", {})
        options = info.get("xla_options") or {}
        print(f"platform {info.get('platform')}; placement {info.get('placement')}; parameters "
              f"{info.get('param_memory')}, optimizer state {info.get('opt_memory')}; XLA options: "
              f"{', '.join(f'{k}={v}' for k, v in options.items()) or 'none'}")  # fmt: skip
        if memory:
            peak = memory.get("temp_size_in_bytes", 0) + memory.get("argument_size_in_bytes", 0)
            print(f"compiled step: {memory.get('temp_size_in_bytes', 0) / 2**20:.1f} MiB temporaries, "
                  f"{memory.get('argument_size_in_bytes', 0) / 2**20:.1f} MiB arguments (~{peak / 2**20:.1f} MiB at its "
                  f"peak), {memory.get('host_temp_size_in_bytes', 0) / 2**20:.1f} MiB host temporaries; buffers live "
                  f"between steps: {folder / 'memory.prof'} (pprof)")  # fmt: skip
    if not sources:
        print(f"(no {hlo.name}: ops are shown without their source)")
    for path, report in reports:
        if len(traces) > 1:
            print(f"\nhost {path.name.removesuffix('.xplane.pb')}:")
        if not report.steps:
            print(f"{path}: no {trace_report.STEP_EVENT!r} steps in the trace (not written by zoo's --profile?)")
            continue
        print(trace_report.format_report(report, top=args.top))


if __name__ == "__main__":
    main()
