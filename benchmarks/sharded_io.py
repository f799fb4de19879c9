"""Sharded I/O: load, init and save of a few-GB checkpoint with no process holding the whole model.

    python benchmarks/sharded_io.py [--preset llama3.2-1b] [--dir /tmp/zoo-sharded-io] [--out benchmarks/results]
                                    [--layouts 1x8,2x4] [--no-peer]

The checkpoint is made by the benchmark itself: ``zoo.llama.preset(PRESET)`` in float32 (Llama
3.2 1B: 1.24B parameters, 4.94 GB), a fresh model made in place on 8 CPU devices and saved by
``zoo.save_pretrained`` (a sharded save). Then, for each layout (processes x CPU devices each,
mesh ``fsdp`` over all devices), every process, in a fresh interpreter:

- **load**: ``zoo.from_pretrained(DIR, mesh=mesh)``: each process reads its shards' byte ranges;
- **init**: ``zoo.Llama(config, key=key, mesh=mesh)``: each device computes its shard;
- **save**: ``zoo.save_pretrained(model, DIR2)`` of the loaded model: tensors gathered and
  streamed one at a time by process 0; the files are then compared with the source's, byte for
  byte (they are the same program's output for the same tensors).

Each phase reports seconds, GB/s (checkpoint bytes / seconds) and the process's peak resident
memory growth (``VmHWM`` after the phase minus ``VmRSS`` before it, the peak reset between phases
by ``/proc/self/clear_refs``), as a multiple of the checkpoint's size; the table gives the worst
process. On CPU a device's memory is the process's memory, so a process's shards (1/P of the
model with P processes) are part of its figure. The peer, in the same run: ``transformers``'s
``AutoModelForCausalLM.from_pretrained(DIR)`` (safetensors, CPU, float32), seconds and peak
growth, in its own interpreter; the ratio is zoo's figure over the peer's.

Targets (issue 24): each process's peak growth at most 0.6x the checkpoint with 2 processes x 4
devices, 1.2x with 1 process x 8, for all three phases.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGETS = {1: 1.2, 2: 0.6}  # processes -> the largest peak growth per process, as a multiple of the checkpoint


def _phase(name: str, fn, nbytes: int, results: dict):
    import gc

    from zoo.runtime import reset_resident_peak, resident_memory

    gc.collect()
    before = reset_resident_peak()
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    results[name] = {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
                     "peak_growth": (resident_memory()[1] - before) / nbytes}  # fmt: skip
    return out


def worker(args: argparse.Namespace) -> None:
    """One process of a layout: load, init and save; prints RESULT {json}."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)
    import gc

    import zoo
    from zoo import parallel

    parallel.initialize_distributed()
    source = Path(args.dir) / "checkpoint"
    nbytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    mesh = parallel.make_mesh({"fsdp": jax.device_count()})
    results: dict = {"process": jax.process_index()}
    model = _phase("load", lambda: jax.block_until_ready(zoo.from_pretrained(source, mesh=mesh)), nbytes, results)
    config = model.config
    saved = Path(args.dir) / f"saved-{args.layout}"
    _phase("save", lambda: zoo.save_pretrained(model, saved), nbytes, results)
    del model
    gc.collect()
    fresh = _phase("init", lambda: jax.block_until_ready(zoo.Llama(config, key=jax.random.key(0), mesh=mesh)), nbytes,
                   results)  # fmt: skip
    del fresh
    print("RESULT " + json.dumps(results), flush=True)


def peer(args: argparse.Namespace) -> None:
    """transformers' own load of the checkpoint (CPU, float32); prints RESULT {json}."""
    import torch
    from transformers import AutoModelForCausalLM

    source = Path(args.dir) / "checkpoint"
    nbytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    results: dict = {}
    _phase("load", lambda: AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), nbytes, results)
    print("RESULT " + json.dumps(results), flush=True)


def make_checkpoint(args: argparse.Namespace) -> None:
    """The source checkpoint: a fresh model made in place on 8 devices, saved."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    import zoo
    from zoo import parallel
    from zoo.llama import preset

    mesh = parallel.make_mesh("fsdp=8")
    model = zoo.Llama(preset(args.preset), key=jax.random.key(1), mesh=mesh)
    zoo.save_pretrained(model, Path(args.dir) / "checkpoint")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], processes: int = 1) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    env["PYTHONPATH"] = str(ROOT)
    if processes > 1:
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", "JAX_NUM_PROCESSES": str(processes)}
    procs = [subprocess.Popen(cmd, env=env | ({"JAX_PROCESS_ID": str(i)} if processes > 1 else {}), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(processes)]  # fmt: skip
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-4000:]}")
        out.extend(json.loads(x[7:]) for x in text.splitlines() if x.startswith("RESULT "))
    return out


def _digests(directory: Path) -> dict[str, str]:
    out = {}
    for p in sorted(directory.glob("model*.safetensors*")):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        out[p.name] = h.hexdigest()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--dir", default="/tmp/zoo-sharded-io", help="where the checkpoints go (a few GB each)")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--layouts", default="1x8,2x4", help="processes x devices per process")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' load")
    p.add_argument("--role", choices=["main", "worker", "peer", "make"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--layout", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role != "main":
        {"worker": worker, "peer": peer, "make": make_checkpoint}[args.role](args)
        return
    me = [sys.executable, str(Path(__file__).resolve()), "--dir", args.dir, "--preset", args.preset]
    source = Path(args.dir) / "checkpoint"
    if not (source / "config.json").exists():
        t = time.perf_counter()
        _run([*me, "--role", "make"])
        print(f"made {source} in {time.perf_counter() - t:.0f} s", flush=True)
    nbytes = sum(q.stat().st_size for q in source.glob("*.safetensors"))
    want = _digests(source)
    rows = []
    for layout in args.layouts.split(","):
        procs, devices = (int(x) for x in layout.split("x"))
        results = _run([*me, "--role", "worker", "--devices", str(devices), "--layout", layout], procs)
        same = _digests(Path(args.dir) / f"saved-{layout}") == want
        for phase in ("load", "init", "save"):
            worst = max(r[phase]["peak_growth"] for r in results)
            slowest = max(r[phase]["seconds"] for r in results)
            rows.append((layout, phase, slowest, nbytes / slowest / 1e9, worst, TARGETS.get(procs), same))
        print(rows[-3:], flush=True)
    peer_load = None if args.no_peer else _run([*me, "--role", "peer"])[0]["load"]
    date = datetime.date.today().isoformat()
    lines = [
        f"# Sharded I/O: {args.preset} float32, {nbytes / 1e9:.2f} GB of safetensors ({date}, {os.cpu_count()} CPU cores)",
        "",
        "`python benchmarks/sharded_io.py` (mesh fsdp over all devices; peak = the worst process's resident-memory",
        "growth during the phase, as a multiple of the checkpoint; the saved files compared with the source's by SHA-256).",
        "",
        "| processes x devices | phase | seconds | GB/s | peak growth / checkpoint | target | saved files identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, phase, seconds, rate, growth, target, same in rows:
        mark = "" if target is None else f"<= {target}x ({'met' if growth <= target else 'missed'})"
        lines.append(f"| {layout} | {phase} | {seconds:.1f} | {rate:.2f} | {growth:.2f}x | {mark} | {'yes' if same else 'NO'} |")
    if peer_load is not None:
        lines += ["", "Peer, same run: `transformers` `AutoModelForCausalLM.from_pretrained` (safetensors, CPU, float32), one process:", "",
                  "| peer | seconds | GB/s | peak growth / checkpoint |", "|---|---|---|---|",
                  f"| transformers load | {peer_load['seconds']:.1f} | {nbytes / peer_load['seconds'] / 1e9:.2f} | "
                  f"{peer_load['peak_growth']:.2f}x |", ""]  # fmt: skip
        for layout, phase, seconds, _, growth, _, _ in rows:
            if phase == "load":
                lines.append(f"- zoo {layout} load / transformers load: time {seconds / peer_load['seconds']:.2f}x, "
                             f"peak growth per process {growth / peer_load['peak_growth']:.2f}x")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out) / f"sharded_io-cpu-{os.cpu_count()}core-{date}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
