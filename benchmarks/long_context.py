"""Long sequences: how far one training step's sequence goes on one device and with context parallelism.

    python benchmarks/long_context.py [--platform cpu|gpu] [--quick] [--budget-gib 12] [--context 8]
                                      [--seqs 1024,2048,...] [--time-seqs 256,...] [--steps 3]
                                      [--out benchmarks/results] [--maxtext-python PY]

**Memory** (no allocation: every step is lowered with abstract arguments and compiled ahead of
time, so 32K tokens compile on a laptop). The shape: ``zoo.llama.preset("llama3.2-1b")`` cut to
2 layers, float32, batch 1, placement ``remat``; one step is loss and gradients. For each
sequence length S of ``--seqs`` it reports ``memory_analysis().temp_size_in_bytes`` of:

- dense attention (``attention="xla"``: ``[B, H, S, S]`` scores) or blockwise attention
  (``attention="blockwise"``: :mod:`zoo.layers.flash_attention`), each with
- the full loss (``zoo.loss.cross_entropy`` of the model's ``[B, S, V]`` float32 logits) or the
  chunked one (``zoo.lm_loss``, the training loss: never the whole logits);
- blockwise + chunked under context parallelism on ``--context`` devices (``zoo.parallel``,
  mesh ``context=N``; simulated CPU devices on CPU), per device.

Then, for dense + full loss, blockwise + chunked loss and context parallelism, the longest S
(a multiple of 1024, found by doubling then bisection, to within 1/32) whose whole step fits
``--budget-gib`` per device: arguments + outputs + temps - aliased (the arguments and outputs
are the parameters and their gradients, 2 x 1.43 GiB here). The searches compile with LLVM's
optimisation and XLA:CPU's fusion emitters off, ~2-3x faster (the buffer sizes are the same:
checked at 16K and 32K), and so does the table.

**Step time** of the same four variants on a shape a 2-core CPU can run: the ``bench`` preset
(d_model 512, 8 query heads of 64, 4 KV heads, MLP 1536, vocab 8192) cut to 2 layers, float32,
batch 1, placement ``remat``; for each S of ``--time-seqs`` the four are compiled, then timed
interleaved (one warm-up each, then ``--steps`` rounds), median. Blockwise over dense (chunked
loss) shows where blockwise attention starts to pay on this machine.

**MaxText** (its ``dot_product`` attention and its pure-JAX flash fallback) is reported only where
its interpreter exists (``benchmarks/maxtext_setup.sh``); otherwise the table says it is not
installed. There, ``benchmarks/peer_maxtext_memory.py`` runs under that interpreter and compiles
MaxText's own model and training loss (loss + gradients, same shape, ``remat_policy=full``) for
the table's lengths on CPU, with the same compile options; its temp bytes fill the two columns, or
the reason there is none (``attention=flash`` has no CPU path). No figure is ever filled in for it.

Prints the markdown and writes it with a PNG (temps vs S, log-log, with the budget; step time vs
S) to ``<out>/long_context-<machine>-<date>[-quick].{md,png}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from placement import fmt_bytes, known_compile_options, setup_platform  # noqa: E402  (no JAX at module level)

GiB = 2**30
PLACEMENT = "remat"
STEP = 1024  # the searches' granularity (a multiple of 2 x context for every context <= 512)
# name -> (attention path, loss)
VARIANTS: dict[str, tuple[str, str]] = {
    "dense + full loss": ("xla", "full"),
    "dense + chunked loss": ("xla", "chunked"),
    "blockwise + full loss": ("blockwise", "full"),
    "blockwise + chunked loss": ("blockwise", "chunked"),
}
BEFORE, AFTER = "dense + full loss", "blockwise + chunked loss"
TARGET_SEQ, TARGET_GIB = 16384, 12.0  # the target: 16K tokens with at most 12 GiB of temps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--quick", action="store_true", help="fewer lengths and steps (a smoke run)")
    p.add_argument("--budget-gib", type=float, default=12.0, help="per-device budget for the longest-S search")
    p.add_argument("--context", type=int, default=8, help="context-parallel devices (simulated on CPU; 1: none)")
    p.add_argument("--seqs", default=None, help="sequence lengths of the memory table (default 1K..32K)")
    p.add_argument("--time-seqs", default=None, help="sequence lengths timed on the bench shape (default 256..4096)")
    p.add_argument("--steps", type=int, default=None, help="timed rounds per length (default 3; --quick 2)")
    p.add_argument("--max-seq", type=int, default=1 << 20, help="upper end of the longest-S searches")
    p.add_argument("--no-search", action="store_true", help="skip the longest-S searches")
    p.add_argument("--out", default=str(HERE / "results"), help="directory for the .md and .png ('' : none)")
    p.add_argument("--maxtext-python", default=None, help="MaxText's interpreter (default: benchmarks/.venv-maxtext)")
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.seqs = ints(args.seqs) if args.seqs else ([1024, 4096, 16384, 32768] if args.quick else
                                                   [1024, 2048, 4096, 8192, 16384, 32768])  # fmt: skip
    args.time_seqs = ints(args.time_seqs) if args.time_seqs is not None else ([256, 1024] if args.quick else
                                                                             [256, 512, 1024, 2048, 4096])  # fmt: skip
    args.steps = args.steps or (2 if args.quick else 3)
    return args


def k(s: int) -> str:
    """1024 -> "1K", 1536 -> "1.5K", 256 -> "256"."""
    if s < 1024:
        return str(s)
    return f"{s / 1024:g}K"


def maxtext_status(python: str | None) -> str:
    """What the MaxText columns say: never a number this script did not measure."""
    import train_step

    ns = argparse.Namespace(maxtext_python=python)
    py = train_step.maxtext_python(ns)
    if py is None:
        return f"MaxText: not installed (run benchmarks/maxtext_setup.sh; {train_step.maxtext_unavailable_reason()})"
    # MaxText's own ahead-of-time tool (train_compile) compiles for a TPU or GPU topology only:
    # peer_maxtext_memory.py lowers its model and loss on CPU instead (maxtext_memory).
    return f"MaxText: installed ({py})"


def maxtext_memory(python: str | None, seqs: list[int], options: dict | None, log) -> tuple[dict, str]:
    """{(kernel, S): peer_maxtext_memory.py's result} and a note for the table (empty: not run)."""
    import json
    import subprocess

    import train_step

    py = train_step.maxtext_python(argparse.Namespace(maxtext_python=python))
    if py is None:
        return {}, ""
    spec = {"seqs": seqs, "kernels": ["dot_product", "flash"], "compile_options": options or {}}
    log(f"MaxText: compiling its step for S = {', '.join(k(s) for s in seqs)} (peer_maxtext_memory.py)")
    proc = None
    try:
        proc = subprocess.run([py, str(HERE / "peer_maxtext_memory.py"), json.dumps(spec)], capture_output=True,
                              text=True, timeout=4 * 3600)  # fmt: skip
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        out, err = e.stdout or "", "timed out after 4 h"
        out = out.decode() if isinstance(out, bytes) else out
    except OSError as e:  # --maxtext-python that does not run
        out, err = "", f"{type(e).__name__}: {e}"
    res = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            res[(r["kernel"], r["seq"])] = r
            log(f"MaxText {r['kernel']} S={k(r['seq'])}: "
                + (fmt_bytes(r["temp"]) + " temps" if "temp" in r else r["error"][:120]))  # fmt: skip
    tail = " ".join(err.strip().splitlines()[-2:])[-200:]
    for key in ((kern, s) for kern in spec["kernels"] for s in seqs):
        how = f"exited {proc.returncode}" if proc else "did not finish"
        res.setdefault(key, {"error": f"peer_maxtext_memory.py {how}: {tail}"})
    versions = next((r["versions"] for r in res.values() if "versions" in r), {})
    no_path = next((r["no_path"] for r in res.values() if "no_path" in r), None)
    note = (f"MaxText {versions.get('maxtext', '?')} (jax {versions.get('jax (maxtext)', '?')}, its own venv), "
            "`benchmarks/peer_maxtext_memory.py`: its `models.Transformer` (llama2 decoder block, scanned layers, "
            "`remat_policy=full`, tied embeddings) and its training `loss_fn` (cross-entropy of the full [B, S, V] "
            "logits against one-hot targets), gradients with respect to the parameters, compiled on CPU with the "
            "same options" + (f"; flash: no such path on CPU ({no_path})" if no_path else ""))  # fmt: skip
    failed = [f"{kern} S={k(s)}: {r['error'][:200]}" for (kern, s), r in res.items()
              if "error" in r and "no_path" not in r]  # fmt: skip
    return res, note + ("; failed: " + "; ".join(failed) if failed else "")


def main(argv: list[str] | None = None) -> Path | None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    setup_platform(args.platform)
    import jax

    if args.platform == "cpu" and args.context > 1:
        jax.config.update("jax_num_cpu_devices", args.context)  # before any JAX operation

    import dataclasses
    import functools

    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    import zoo
    from zoo import parallel
    from zoo.loss import cross_entropy

    options = known_compile_options({"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}) \
        if args.platform == "cpu" else None  # fmt: skip
    device = jax.devices()[0]
    big = dataclasses.replace(zoo.llama.preset("llama3.2-1b"), num_layers=2)
    small = dataclasses.replace(zoo.llama.preset("bench"), num_layers=2)

    def loss_fn(kind: str):
        if kind == "full":
            return lambda m, ids: cross_entropy(m(ids, placement=PLACEMENT)[:, :-1], ids[:, 1:])
        return lambda m, ids: zoo.lm_loss(m, ids, placement=PLACEMENT)

    def step_fn(kind: str):
        vg = eqx.filter_value_and_grad(loss_fn(kind))
        return jax.jit(lambda m, ids: vg(m, ids))

    def log(msg: str) -> None:
        print(f"  [{time.perf_counter() - t_start:5.0f} s] {msg}", file=sys.stderr, flush=True)

    # -- memory ------------------------------------------------------------------------------
    abstract = {}
    for attn in ("xla", "blockwise"):
        cfg = dataclasses.replace(big, attention=attn)
        abstract[attn] = eqx.filter_eval_shape(lambda cfg=cfg: zoo.Llama(cfg, key=jax.random.key(0)))

    mesh = sharded = cp_step = None
    cp_reason = None
    if args.context > 1:
        if jax.device_count() != args.context:
            cp_reason = f"needs {args.context} devices, {jax.device_count()} present"
        else:
            mesh = parallel.make_mesh(f"context={args.context}")
            specs: list = []

            def make():  # the PartitionSpecs need the model's arrays: taken while it is traced
                model = zoo.Llama(dataclasses.replace(big, attention="auto"), key=jax.random.key(0))
                specs.append(parallel.partition_specs(model, mesh))
                return model

            plain = eqx.filter_eval_shape(make)
            sharded = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)), plain, specs[0]
            )
            vg = parallel.value_and_grad(functools.partial(zoo.lm_loss, placement=PLACEMENT), mesh)
            # parallel.value_and_grad is an eqx.filter_jit, which would take abstract leaves for
            # static ones: jax.jit around it traces them.
            cp_step = jax.jit(lambda m, ids: vg(m, ids))
    cp_name = f"blockwise + chunked loss, context={args.context}, per device"

    cache: dict[tuple[str, int], dict] = {}

    def memory(name: str, s: int) -> dict:
        """{"temp", "total"} bytes of one compiled step (per device), or {"error"}."""
        if (name, s) in cache:
            return cache[(name, s)]
        ids = jax.ShapeDtypeStruct((1, s), jnp.int32)
        t = time.perf_counter()
        try:
            if name == cp_name:
                lowered = cp_step.lower(sharded, ids)
            else:
                attn, kind = VARIANTS[name]
                lowered = step_fn(kind).lower(abstract[attn], ids)
            st = lowered.compile(options).memory_analysis()
            used = st.argument_size_in_bytes + st.output_size_in_bytes + st.temp_size_in_bytes - st.alias_size_in_bytes
            r = {"temp": st.temp_size_in_bytes, "total": used, "args": st.argument_size_in_bytes,
                 "outputs": st.output_size_in_bytes}  # fmt: skip
        except Exception as e:  # noqa: BLE001  (a compile that fails: reported, counted as not fitting)
            r = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
        log(f"{name} S={k(s)}: " + (fmt_bytes(r["temp"]) + " temps" if "temp" in r else r["error"])
            + f" ({time.perf_counter() - t:.1f} s)")  # fmt: skip
        cache[(name, s)] = r
        return r

    mem_names = [*VARIANTS, *([cp_name] if cp_step is not None else [])]
    for s in args.seqs:
        for name in mem_names:
            if name == cp_name and s % (2 * args.context):
                continue
            memory(name, s)

    budget = args.budget_gib * GiB

    def fits(name: str, s: int) -> bool:
        r = memory(name, s)
        return "total" in r and r["total"] <= budget

    def longest(name: str) -> tuple[int | None, int | None]:
        """(longest S found to fit, shortest S found not to) over multiples of STEP."""
        known = sorted(s for (n, s) in cache if n == name and s % STEP == 0)
        good = max((s for s in known if fits(name, s)), default=None)
        if good is None:
            if not fits(name, STEP):
                return None, STEP
            good = STEP
        bad = min((s for s in known if s > good and not fits(name, s)), default=None)
        while bad is None:
            trial = min(2 * good, args.max_seq // STEP * STEP)
            if trial <= good:
                return good, None
            if fits(name, trial):
                good = trial
            else:
                bad = trial
        while bad - good > max(STEP, good // 32):
            mid = (good + bad) // 2 // STEP * STEP
            good, bad = (mid, bad) if fits(name, mid) else (good, mid)
        return good, bad

    searched = {}
    if not args.no_search:
        for name in (BEFORE, AFTER, *([cp_name] if cp_step is not None else [])):
            searched[name] = longest(name)

    # -- step time ---------------------------------------------------------------------------
    times: dict[tuple[str, int], float] = {}
    load = [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
    rng = np.random.default_rng(0)
    models = {}
    for attn in ("xla", "blockwise"):
        models[attn] = zoo.Llama(dataclasses.replace(small, attention=attn), key=jax.random.key(0))
    for s in args.time_seqs:
        ids = jnp.asarray(rng.integers(0, small.vocab_size, (1, s)), jnp.int32)
        compiled = {}
        for name, (attn, kind) in VARIANTS.items():
            compiled[name] = step_fn(kind).lower(models[attn], ids).compile()
            jax.block_until_ready(compiled[name](models[attn], ids))  # warm-up
        samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.steps):  # interleaved: a busy machine slows every variant alike
            for name, (attn, _) in VARIANTS.items():
                t = time.perf_counter()
                jax.block_until_ready(compiled[name](models[attn], ids))
                samples[name].append(time.perf_counter() - t)
        for name in VARIANTS:
            times[(name, s)] = 1e3 * statistics.median(samples[name])
        log(f"timed S={k(s)}: " + ", ".join(f"{n} {times[(n, s)]:.0f} ms" for n in VARIANTS))
        del compiled
    if load:
        load.append(os.getloadavg()[0])

    # -- report ------------------------------------------------------------------------------
    where = f"cpu, {os.cpu_count()} cores" if device.platform == "cpu" else f"{device.platform} ({device.device_kind})"
    mt = maxtext_status(args.maxtext_python)
    mt_cell = "not installed" if "not installed" in mt else "not run"
    mt_res: dict = {}
    if mt_cell == "not run" and args.platform == "cpu":
        mt_res, mt_note = maxtext_memory(args.maxtext_python, args.seqs, options, log)
        mt = mt_note or mt
    elif mt_cell == "not run":
        mt += " but not run (peer_maxtext_memory.py compiles for CPU only)"

    def mt_fmt(kernel: str, s: int) -> str:
        r = mt_res.get((kernel, s))
        if r is None:
            return mt_cell
        if "temp" in r:
            return f"{r['temp'] / GiB:.2f}"
        if "no_path" in r:
            return "no such path on CPU"
        return "failed: " + r["error"].split(":")[0].replace("|", "/")

    def cell(name: str, s: int) -> str:
        r = cache.get((name, s))
        if r is None:
            return "-"
        return f"{r['temp'] / GiB:.2f}" if "temp" in r else "compile failed"

    fixed = cache[(AFTER, args.seqs[0])]
    fixed_gib = (fixed.get("args", 0) + fixed.get("outputs", 0)) / GiB
    intro = (
        f"Llama 3.2 1B shape cut to 2 layers (d_model {big.hidden_size}, {big.num_heads} query heads of "
        f"{big.head_dim}, {big.num_kv_heads} KV heads, MLP {big.intermediate_size}, vocab {big.vocab_size}), "
        f"float32, batch 1, placement `{PLACEMENT}`, loss + gradients; {where}. "
        f"Compiled temp bytes (GiB) of one step (`memory_analysis()`, no allocation); "
        f"arguments + outputs (parameters and gradients) add {fixed_gib:.2f} GiB."
    )
    lines = [intro, ""]
    header = ["S", *(f"{n}" for n in VARIANTS)]
    if cp_step is not None:
        header.append(cp_name)
    header += ["MaxText dot_product", "MaxText flash (pure JAX)", "blockwise+chunked / dense+full"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---:" for _ in header) + "|")
    for s in args.seqs:
        row = [k(s), *(cell(n, s) for n in VARIANTS)]
        if cp_step is not None:
            row.append(cell(cp_name, s))
        b, a = cache.get((BEFORE, s), {}), cache.get((AFTER, s), {})
        ratio = f"{a['temp'] / b['temp']:.3f}" if "temp" in a and "temp" in b else "-"
        row += [mt_fmt("dot_product", s), mt_fmt("flash", s), ratio]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", mt + ".", ""]
    if cp_reason:
        lines += [f"Context parallelism not measured: {cp_reason}.", ""]

    # Growth with S (the target: about linear for the training path).
    growth = []
    for name in (BEFORE, AFTER, *([cp_name] if cp_step is not None else [])):
        # The longest doubling measured (the table's lengths, or the search's beyond them).
        temps = {s: r["temp"] for (n, s), r in cache.items() if n == name and "temp" in r}
        pairs = [s for s in temps if s // 2 in temps and s % 2 == 0]
        if pairs:
            s1 = max(pairs)
            s0, t0, t1 = s1 // 2, temps[s1 // 2], temps[s1]
            slope = (t1 - t0) / (s1 - s0) * 1024
            growth.append(f"{name}: temps x{t1 / t0:.2f} from {k(s0)} to {k(s1)} (S x{s1 / s0:g}); "
                          f"{slope / 2**20:,.0f} MiB per 1K tokens there")  # fmt: skip
    if growth:
        lines += ["Growth: " + "; ".join(growth) + ".", ""]

    if searched:
        lines += [(f"Longest sequence whose step fits {args.budget_gib:g} GiB per device (arguments + outputs + "
                   f"temps; multiples of {STEP}, to within 1/32):"), "",
                  "| variant | longest S that fits | GiB there | shortest S tried that does not | GiB there |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        for name, (good, bad) in searched.items():
            g = cache.get((name, good), {}) if good else {}
            b = cache.get((name, bad), {}) if bad else {}
            gib = lambda r: f"{r['total'] / GiB:.3f}" if "total" in r else ("compile failed" if r else "-")  # noqa: E731
            lines.append(f"| {name} | {f'{good:,} ({k(good)})' if good else 'none'} | {gib(g)} | "
                         f"{f'{bad:,} ({k(bad)})' if bad else f'none up to {k(args.max_seq)}'} | {gib(b)} |")  # fmt: skip
        lines.append("")

    if times:
        lines += [f"Step time (ms, median of {args.steps} interleaved rounds) on a shape this machine runs: the "
                  f"`bench` preset cut to 2 layers (d_model {small.hidden_size}, {small.num_heads} query heads of "
                  f"{small.head_dim}, {small.num_kv_heads} KV heads, MLP {small.intermediate_size}, vocab "
                  f"{small.vocab_size}), float32, batch 1, placement `{PLACEMENT}`"
                  + (f" (1-minute load average {load[0]:.1f} before the timings, {load[1]:.1f} after, on "
                     f"{os.cpu_count()} cores)" if len(load) == 2 else "") + ":", ""]  # fmt: skip
        th = ["S", *VARIANTS, "blockwise / dense (chunked loss)", "chunked / full (blockwise)"]
        lines += ["| " + " | ".join(th) + " |", "|" + "|".join("---:" for _ in th) + "|"]
        for s in args.time_seqs:
            r1 = times[("blockwise + chunked loss", s)] / times[("dense + chunked loss", s)]
            r2 = times[("blockwise + chunked loss", s)] / times[("blockwise + full loss", s)]
            lines.append("| " + " | ".join([k(s), *(f"{times[(n, s)]:.0f}" for n in VARIANTS), f"{r1:.2f}",
                                            f"{r2:.2f}"]) + " |")  # fmt: skip
        lines.append("")

    # Targets (benchmarks, not tests).
    tgt = ["| target | met | figures |", "|---|---|---|"]
    r16 = cache.get((AFTER, TARGET_SEQ))
    if r16 and "temp" in r16:
        before = cache.get((BEFORE, TARGET_SEQ), {})
        was = f" (dense + full loss: {before['temp'] / GiB:.1f} GiB)" if "temp" in before else ""
        tgt.append(f"| {k(TARGET_SEQ)} tokens with <= {TARGET_GIB:g} GiB of temps | "
                   f"{'yes' if r16['temp'] <= TARGET_GIB * GiB else '**no**'} | {r16['temp'] / GiB:.2f} GiB{was} |")  # fmt: skip
    r32 = cache.get((AFTER, 32768))
    if r32 and "temp" in r32:
        tgt.append(f"| 32K tokens with <= {TARGET_GIB:g} GiB of temps | {'yes' if r32['temp'] <= TARGET_GIB * GiB else '**no**'} "
                   f"| {r32['temp'] / GiB:.2f} GiB |")  # fmt: skip
        ok = r32["total"] <= budget
        best = searched.get(AFTER, (None, None))[0]
        tgt.append(f"| 32K tokens: whole step (arguments + outputs + temps) within the {args.budget_gib:g} GiB budget | "
                   f"{'yes' if ok else '**no**'} | {r32['total'] / GiB:.2f} GiB"
                   + (f"; longest that fits: {k(best)}" if best else "") + " |")  # fmt: skip
    if r16 and r32 and "temp" in r16 and "temp" in r32:
        x = r32["temp"] / r16["temp"]
        tgt.append(f"| temps about linear in S (x2 from 16K to 32K) | {'yes' if 1.5 <= x <= 2.5 else '**no**'} | "
                   f"x{x:.2f} |")  # fmt: skip
    if len(tgt) > 2:
        lines += tgt + [""]
    lines.append(f"({time.perf_counter() - t_start:.0f} s in all.)")
    text = "\n".join(lines)

    # -- files -------------------------------------------------------------------------------
    md_path = None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        machine = f"cpu-{os.cpu_count()}core" if args.platform == "cpu" else \
            "gpu-" + "-".join("".join(c if c.isalnum() else " " for c in device.device_kind.lower()).split())  # fmt: skip
        stem = f"long_context-{machine}-{datetime.date.today().isoformat()}{'-quick' if args.quick else ''}"
        png = chart(cache, times, searched, args, mem_names, out / f"{stem}.png")
        md_path = out / f"{stem}.md"
        cmd = "python benchmarks/long_context.py" + (f" --platform {args.platform}" if args.platform != "cpu" else "") \
            + (" --quick" if args.quick else "")  # fmt: skip
        head = [f"# Long sequences: {where}, {datetime.date.today().isoformat()}", "",
                f"`{cmd}` (jax {jax.__version__})", ""]  # fmt: skip
        if png:
            head += [f"![long sequences]({png.name})", ""]
        md_path.write_text("\n".join(head) + "\n" + text + "\n")
        print(f"wrote {md_path}" + (f" and {png}" if png else ""), file=sys.stderr)
    print(text)
    return md_path


def chart(cache: dict, times: dict, searched: dict, args, names: list[str], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart", file=sys.stderr)
        return None
    from matplotlib.ticker import FuncFormatter

    def ticker():  # one formatter per axis
        return FuncFormatter(lambda x, _: k(round(x)) if x >= 1 else "")

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    fixed = None
    for i, name in enumerate(names):
        pts = sorted((s, r["temp"] / GiB) for (n, s), r in cache.items() if n == name and "temp" in r)
        if not pts:
            continue
        if fixed is None:
            r = next(r for (n, _), r in cache.items() if n == name and "temp" in r)
            fixed = (r["args"] + r["outputs"]) / GiB
        label = name
        if name in searched and searched[name][0]:
            label += f" (fits up to {k(searched[name][0])})"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=label, ms=4)
        if name in searched and searched[name][0]:
            ax.axvline(searched[name][0], color=f"C{i}", ls=":", lw=1)
    ax.axhline(args.budget_gib, color="k", ls="--", lw=1, label=f"budget {args.budget_gib:g} GiB")
    if fixed is not None:
        ax.axhline(args.budget_gib - fixed, color="k", ls=":", lw=1,
                   label=f"budget less parameters + gradients ({fixed:.1f} GiB)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(ticker())
    ax.set_xlabel("sequence length S (whole sequence; dotted: the longest that fits)")
    ax.set_ylabel("compiled temp GiB per device")
    ax.set_title("Llama 3.2 1B shape, 2 layers, f32, batch 1, remat: temps vs S")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    for i, name in enumerate(VARIANTS):
        pts = sorted((s, ms) for (n, s), ms in times.items() if n == name)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}", label=name, ms=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(ticker())
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("ms / step (loss + gradients)")
    ax.set_title("step time, bench shape cut to 2 layers, batch 1")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
