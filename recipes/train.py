"""Train any zoo family (Llama 3.1, DeepSeek-V3, Qwen3, Qwen3-MoE): from a preset, or fine-tune a
Hugging Face checkpoint.

    python recipes/train.py                                   # small Llama on the embedded corpus (CPU, minutes)
    python recipes/train.py --model deepseek_v3 --preset small --mesh expert=8 --cpu-devices 8
    python recipes/train.py --model qwen3_moe --preset small
    python recipes/train.py --checkpoint path/to/Llama-3.2-1B --data my.txt --steps 200
    python recipes/train.py --checkpoint path/to/Llama-3.2-1B-Instruct --data chats.jsonl   # loss on the assistant's turns

The embedded corpus is byte-level text of the Python standard library's own sources (vocab 256),
so the byte-level presets (tiny, small) train with no download. A checkpoint's tokenizer.json
tokenizes the data (once, into a cache); documents are packed into rows. Every flag: --help.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo import registry

MODELS = tuple(registry.model_types())


# Optimiser defaults. From scratch: a small model's pretraining rate. With --checkpoint, a
# pretrained model's fine-tuning: TRL's SFTConfig defaults (learning rate 2e-5, no weight decay;
# transformers' Trainer uses 5e-5), which keep what pretraining learned: at 5e-3 a real 135M
# instruct checkpoint's held-out loss went from 1.92 to 11.2 in 5 steps.
PRETRAINING = {"lr": 5e-3, "weight_decay": 0.1}
FINE_TUNING = {"lr": 2e-5, "weight_decay": 0.0}


def _option_flags(group: argparse._ArgumentGroup) -> None:
    """A flag per field of every family's training options (``--mtp-weight`` ...); unset flags
    keep the family's defaults."""
    seen: set[str] = set()
    for family in registry.families():
        for f in dataclasses.fields(family.training_options):
            if f.name in seen:
                continue
            seen.add(f.name)
            kind = float if isinstance(f.default, float) or f.default is None else type(f.default)
            group.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None, help=f.metadata.get("help"))


def training_options(model, args: argparse.Namespace):
    """The model family's training options from the flags that were given."""
    cls = type(model).training_options
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}
    return cls(**given)


def positive(text: str) -> float:
    """A flag's value that must be a finite number > 0 (a learning rate, a clip norm)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=MODELS, default="llama", help="model type (default llama)")
    m.add_argument("--preset", default="small", help="config preset, e.g. small, tiny, bench, llama3.1-8b (default small)")
    m.add_argument("--checkpoint", help="a Hugging Face checkpoint directory to fine-tune (overrides --model/--preset)")
    m.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32", help="activation dtype")
    m.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32", help="parameter dtype")
    m.add_argument("--attention", choices=["auto", "xla", "blockwise", "cudnn", "splash", "pallas_gpu"], default="auto",
                   help="attention path: auto picks splash (TPU), cuDNN (GPU, bf16, unpacked), the Pallas GPU kernel "
                        "(GPU, bf16, packed), blockwise (long sequences, context parallelism) or dense XLA "
                        "(see docs/models.md)")  # fmt: skip
    d = p.add_argument_group("data")
    d.add_argument("--data", default="stdlib",
                   help="'stdlib' (embedded), a .npy token file, or comma-separated text files, JSON lines (.jsonl), "
                        "Parquet files, saved Hugging Face dataset directories and hub datasets (hf:NAME[:CONFIG]; see docs/data.md)")  # fmt: skip
    d.add_argument("--text-field", default="text", help="the field of a JSON-lines/Parquet/dataset record that holds its text")
    d.add_argument("--data-format", choices=["auto", "text", "chat", "completion"], default="auto",
                   help="auto: a record with 'messages' is a chat (loss on the assistant's turns), with 'prompt' and "
                        "'completion' a pair (loss on the completion), else text")  # fmt: skip
    d.add_argument("--data-cache", default=None, help="where tokenized data is cached (default $ZOO_CACHE_DIR/data or ~/.cache/zoo/data)")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--seq-len", type=int, default=128)
    d.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    d.add_argument("--microbatches", type=int, default=None,
                   help="with a pipeline mesh axis: micro-batches each device's rows are cut into and passed through "
                        "the stages (default: one per stage; more shrink the bubble (P-1)/(M+P-1))")  # fmt: skip
    d.add_argument("--virtual-stages", type=int, default=1,
                   help="with a pipeline mesh axis: the interleaved schedule, each stage's layers in V chunks "
                        "(bubble (P-1)/(V*M+P-1); --microbatches a multiple of the stages; default 1: GPipe)")  # fmt: skip
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=250)
    o.add_argument("--lr", type=positive, default=None,
                   help=f"peak learning rate (> 0; default {PRETRAINING['lr']:g} from scratch, "
                        f"{FINE_TUNING['lr']:g} with --checkpoint)")  # fmt: skip
    o.add_argument("--warmup", type=int, default=None,
                   help="linear warm-up steps, then cosine decay (default min(20, steps // 10))")  # fmt: skip
    o.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    o.add_argument("--weight-decay", type=float, default=None,
                   help=f"AdamW decoupled decay, not on norms/biases (default {PRETRAINING['weight_decay']:g} from "
                        f"scratch, {FINE_TUNING['weight_decay']:g} with --checkpoint)")  # fmt: skip
    o.add_argument("--clip", type=positive, default=1.0, help="global gradient-norm clip (> 0)")
    o.add_argument("--seed", type=int, default=0, help="init and data seed (batches depend on (seed, step) only)")
    _option_flags(o)
    x = p.add_argument_group("memory and parallelism")
    x.add_argument("--placement", default=None,
                   help="activation placement: a preset name, 'name=where,...' (see docs/placement.md), or 'auto': "
                        "zoo.plan's fastest map within the device budget, with parameter and optimizer memory")  # fmt: skip
    x.add_argument("--param-memory", choices=["device", "pinned_host"], default="device")
    x.add_argument("--opt-memory", choices=["device", "pinned_host"], default="device")
    x.add_argument("--hardware", default=None,
                   help="--placement auto: the hardware of zoo.plan's table (default: from the device kind; 'cpu' on CPU)")
    x.add_argument("--device-budget-gib", type=float, default=None,
                   help="--placement auto: memory per device (default: the device's own limit, else the hardware's HBM)")
    x.add_argument("--mesh", default="",
                   help="e.g. data=2,fsdp=2,tensor=2 (axes pipeline, data, fsdp, context, tensor, expert; pipeline "
                        "splits the layer stack into stages, context the sequence)")  # fmt: skip
    x.add_argument("--cpu-devices", type=int, default=None, help="simulate this many CPU devices")
    x.add_argument("--coordinator", default=None, help="multi-host: coordinator host:port (or JAX_COORDINATOR_ADDRESS)")
    x.add_argument("--num-processes", type=int, default=None, help="multi-host: process count")
    x.add_argument("--process-id", type=int, default=None, help="multi-host: this process's id")
    x.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an XLA compile option of the train step, on top of the backend's set (repeatable; e.g. "
                        "xla_gpu_enable_pipelined_all_reduce=false); one the installed jaxlib lacks is dropped with a "
                        "warning (docs/training.md, XLA options)")  # fmt: skip
    x.add_argument("--no-xla-defaults", action="store_true",
                   help="compile the step without the backend's XLA option set (zoo.runtime.XLA_OPTIONS), only "
                        "--xla-option's")  # fmt: skip
    r = p.add_argument_group("run")
    r.add_argument("--run-dir", default=None,
                   help="metrics.jsonl, loss.png and checkpoints/ go here (default runs/MODEL-PRESET, or "
                        "runs/NAME for --checkpoint path/to/NAME)")  # fmt: skip
    run = r.add_mutually_exclusive_group()
    run.add_argument("--resume", action="store_true", help="continue from the latest good checkpoint in --run-dir")
    run.add_argument("--overwrite", action="store_true",
                     help="remove a previous run's metrics, checkpoints and loss.png from --run-dir first")  # fmt: skip
    r.add_argument("--allow-change", default="", metavar="NAMES",
                   help="--resume: settings the resumed run may change, comma-separated (e.g. lr,steps); any other "
                        "difference from the run's run.json is refused, listed (docs/training.md, Resuming)")  # fmt: skip
    r.add_argument("--log-every", type=int, default=25)
    r.add_argument("--eval-every", type=int, default=50)
    r.add_argument("--checkpoint-every", type=int, default=200)
    r.add_argument("--keep-checkpoints", type=int, default=3, help="how many recent checkpoints to keep (>= 1)")
    r.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: measured matmul peak)")
    r.add_argument("--profile", default=None, metavar="START:STOP",
                   help="trace steps START..STOP-1 (the first step is 1) into RUN_DIR/profile; read it with "
                        "python recipes/profile.py RUN_DIR (docs/placement.md, Reading the profile)")  # fmt: skip
    r.add_argument("--save-hf", default=None, help="also write the trained model as a Hugging Face checkpoint here")
    r.add_argument("--wandb", metavar="PROJECT", default=None,
                   help="also log to this Weights & Biases project (needs wandb; WANDB_MODE=offline logs without an "
                        "account, files in RUN_DIR/wandb)")  # fmt: skip
    return p


def default_run_dir(args: argparse.Namespace) -> str:
    """``runs/MODEL-PRESET`` (``runs/llama-small``), or ``runs/NAME`` for ``--checkpoint .../NAME``."""
    if args.checkpoint:
        return str(Path("runs") / (Path(args.checkpoint).resolve().name or "checkpoint"))
    return str(Path("runs") / f"{args.model}-{args.preset}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    for name in ("batch_size", "seq_len", "grad_accum", "steps", "log_every", "eval_every", "checkpoint_every",
                 "keep_checkpoints"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.microbatches is not None and args.microbatches < 1:
        p.error(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.virtual_stages < 1:
        p.error(f"--virtual-stages must be >= 1, got {args.virtual_stages}")
    if args.seq_len < 2:
        p.error(f"--seq-len must be >= 2 (a next-token loss predicts position t+1 from t), got {args.seq_len}")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        p.error(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
    for name, value in (FINE_TUNING if args.checkpoint else PRETRAINING).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.run_dir is None:  # one per model: a run of another model never lands in this one's directory
        args.run_dir = default_run_dir(args)
    from zoo.errors import ConfigError
    from zoo.runtime import parse_xla_option
    from zoo.train.profile import check_window

    try:
        args.xla_options = dict(parse_xla_option(o) for o in args.xla_option)
    except ValueError as e:
        p.error(f"--xla-option: {e}")
    try:
        args.profile = check_window(args.profile, args.steps, args.run_dir)
    except ConfigError as e:
        p.error(f"--{e}")
    if args.warmup is None:  # a short run gets a short warm-up, so --steps alone is always valid
        args.warmup = min(20, args.steps // 10)
    elif args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    elif args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    return args


def hardware_name(device) -> str:
    """The ``zoo.plan`` hardware of a JAX device: its platform on CPU, else the first table
    name within its device kind (``"NVIDIA H200"`` -> ``h200``)."""
    from zoo.plan.hardware import HARDWARE, for_device

    name = for_device(device)
    if name is not None:
        return name
    parser().error(f"--placement auto: device kind {device.device_kind!r} is not in zoo.plan's hardware table "
                   f"({', '.join(HARDWARE)}); name one with --hardware")  # fmt: skip
    raise AssertionError  # (parser().error exits)


def plan_placement(args: argparse.Namespace, model, mesh) -> None:
    """``--placement auto``: zoo.plan's fastest placement map, parameter and optimizer memory
    for this model, mesh, batch and sequence within the device budget; printed, then set on
    ``args``. Nothing fits: a usage error with the planner's table."""
    import jax

    from zoo import plan as planning
    from zoo.errors import ConfigError, MeshError

    device = jax.devices()[0]
    hw = args.hardware or hardware_name(device)
    budget = args.device_budget_gib * 2**30 if args.device_budget_gib else None
    if budget is None:
        stats = device.memory_stats() or {}
        budget = stats.get("bytes_limit")  # the device's own allocator limit, where it has one
    if device.platform == "gpu":  # the link this machine really has, where slower than the table's
        from zoo.plan.hardware import hardware, measure_host_link

        entry = hardware(hw)
        measured = min(measure_host_link(device))
        print(f"host link measured: {measured / 1e9:.1f} GB/s per direction (table: {entry.host_link / 1e9:.0f})", flush=True)
        if measured < entry.host_link:
            hw = dataclasses.replace(entry, host_link=measured)
    try:
        # The schedule this run will use (--virtual-stages), not one the planner would choose.
        result = planning.plan(model, seq_len=args.seq_len, batch_size=args.batch_size, mesh=mesh, hardware=hw,
                               device_budget=budget, compute_dtype=model.compute_dtype, verify=False,
                               virtual_stages=args.virtual_stages)  # fmt: skip
    except (ConfigError, MeshError) as e:
        parser().error(f"--placement auto: {e}")
    print(result, flush=True)
    if device.platform != "cpu":
        check_plan_host_memory(result, 1 if mesh is None else len(mesh.local_devices))
    args.placement, args.param_memory, args.opt_memory = result.placement, result.param_memory, result.opt_memory


def size_host_pool(args: argparse.Namespace) -> None:
    """Size XLA's pinned host pool (GPU; ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, 64 GiB by default)
    for what the run puts in host memory, before the backend starts: the estimate of the step
    (zoo.plan.estimate) for this process's devices; ``--placement auto`` plans after the backend
    starts, so its pool is capped at the machine's memory (the pool grows on demand) and the plan
    is checked against it (:func:`check_plan_host_memory`). A usage error when the machine has too little."""
    import jax.numpy as jnp

    from zoo import CheckpointError, MeshError, parallel
    from zoo import plan as planning
    from zoo import runtime
    from zoo.errors import ConfigError
    from zoo.placement import PlacementError

    if args.cpu_devices or os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return  # XLA:CPU has one memory and no pinned pool
    if args.placement == "auto":
        total = runtime.physical_memory()
        if total is not None and runtime.HOST_POOL_ENV not in os.environ:
            os.environ[runtime.HOST_POOL_ENV] = str(max(runtime.HOST_POOL_DEFAULT_GIB, total // 2**30))
        return
    try:
        if args.checkpoint:
            from zoo.hf.pretrained import read_config

            family, config, _ = read_config(args.checkpoint)
            config = dataclasses.replace(config, attention=args.attention)
        else:
            family = registry.by_model_type(args.model, "--model")
            config = dataclasses.replace(family.config_cls.preset(args.preset, args.model), attention=args.attention)
        placement = family.placement_map.parse(args.placement) if args.placement else None
        sizes = parallel.parse_mesh(args.mesh) if args.mesh else {}
    except (CheckpointError, ConfigError, MeshError, PlacementError) as e:
        parser().error(str(e))  # the same checks run again, with their flags named, where the model is built
    if "pinned_host" not in (args.param_memory, args.opt_memory) and not (placement and placement.placed("pinned_host")):
        return
    devices = math.prod(sizes.values()) // (args.num_processes or 1) if sizes else 1
    try:
        need = planning.estimate(config, batch_size=args.batch_size, seq_len=args.seq_len, placement=placement,
                                 mesh=args.mesh or None, param_memory=args.param_memory, opt_memory=args.opt_memory,
                                 compute_dtype=jnp.dtype(args.compute_dtype)).host_bytes * max(devices, 1)  # fmt: skip
        gib = runtime.size_host_pool(need, what="the run's placements")
    except ConfigError as e:
        parser().error(str(e))
    print(f"pinned host memory: {need / 2**30:.1f} GiB estimated for this process; XLA's pool capped at {gib} GiB",
          flush=True)  # fmt: skip


def check_plan_host_memory(plan, devices: int) -> None:
    """``--placement auto``: the plan's host memory for this process's devices within XLA's pool and the machine."""
    from zoo import runtime
    from zoo.errors import ConfigError

    need = plan.estimate.host_bytes * devices
    if need <= 0:
        return
    try:
        runtime.size_host_pool(need, what="the plan")
    except ConfigError as e:
        parser().error(f"--placement auto: {e}")


def mesh_share(mesh) -> str:
    """Where this process's devices sit on ``mesh``: the indices they take on each axis over 1
    (``pipeline 1, fsdp 0-3``): a multi-host layout is checked at a glance."""
    import jax
    import numpy as np

    mine = np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices)
    parts = []
    for i, axis in enumerate(mesh.axis_names):
        if mine.shape[i] > 1:
            at = np.flatnonzero(mine.any(axis=tuple(j for j in range(mine.ndim) if j != i))).tolist()
            contiguous = len(at) > 1 and at == list(range(at[0], at[-1] + 1))
            parts.append(f"{axis} {at[0]}-{at[-1]}" if contiguous else f"{axis} {','.join(map(str, at))}")
    return ", ".join(parts)


def count(n: int, unit: str) -> str:
    """``n`` things in units that fit: ``3,259 tokens``, ``1.2M tokens``, ``3.4B tokens``."""
    if n < 10**6:
        return f"{n:,} {unit}"
    return f"{n / 1e6:.1f}M {unit}" if n < 10**9 else f"{n / 1e9:.1f}B {unit}"


def build_model(args: argparse.Namespace, mesh, param_dtype, compute_dtype):
    """The model of ``--checkpoint`` or ``--model``/``--preset``, made in place on ``mesh`` where
    there is one: each process reads or initialises only its devices' shards."""
    import jax.random as jr

    import zoo

    if args.checkpoint:
        return zoo.from_pretrained(args.checkpoint, dtype=param_dtype, compute_dtype=compute_dtype,
                                   attention=args.attention, mesh=mesh)  # fmt: skip
    cls = registry.by_model_type(args.model, "--model")
    config = dataclasses.replace(cls.config_cls.preset(args.preset, args.model), attention=args.attention)
    if getattr(config, "num_nextn_predict_layers", 0) == 1:  # DeepSeek-V3 presets: train their MTP module
        config = dataclasses.replace(config, mtp=True)
    return cls(config, key=jr.key(args.seed), mesh=mesh, param_dtype=param_dtype, compute_dtype=compute_dtype)


def check_save_hf(args: argparse.Namespace) -> None:
    """``--save-hf``: a directory the trained model can go to, known before the first step: not a
    file, not under one, not the checkpoint being fine-tuned (its base weights would be
    replaced) and not the run dir."""
    from zoo import CheckpointError
    from zoo.hf.pretrained import check_save_path

    target = Path(args.save_hf).resolve()
    try:
        check_save_path(target)
    except CheckpointError as e:
        parser().error(f"--save-hf {args.save_hf}: {e}")
    if args.checkpoint and target == Path(args.checkpoint).resolve():
        parser().error(f"--save-hf {args.save_hf} is the --checkpoint being fine-tuned: saving there would replace its "
                       "base weights; choose another directory")  # fmt: skip
    if target == Path(args.run_dir).resolve():
        parser().error(f"--save-hf {args.save_hf} is the --run-dir; choose another directory (e.g. {Path(args.run_dir) / 'hf'})")


def sources(args: argparse.Namespace) -> dict[str, str | None]:
    """What the run is made from, as ``run.json`` keeps it (paths resolved, so that the same
    file named another way is the same source)."""

    def resolved(name: str | None) -> str | None:
        if name is None:
            return None
        return ",".join(str(Path(n).resolve()) if Path(n).exists() else n for n in name.split(","))

    return {"data": resolved(args.data), "checkpoint": resolved(args.checkpoint), "text_field": args.text_field,
            "data_format": args.data_format}  # fmt: skip


def load_training_data(args: argparse.Namespace, vocab_size: int):
    """The data of ``--data``, tokenized with the checkpoint's tokenizer.json (bytes without one);
    says which tokenizer it uses. Bad data is a usage error before anything compiles."""
    import jax

    from zoo import data as zdata
    from zoo.errors import ConfigError

    # Many processes split the tokenizing (each its share of the records) and all read the
    # merged cache entry (zoo.data.Share); the cache directory is shared in a cluster.
    share = zdata.Share(jax.process_index(), jax.process_count(), _barrier) if jax.process_count() > 1 else None
    try:
        tokenizer = zdata.load_tokenizer(args.checkpoint)
        print(f"tokenizer: {tokenizer.describe()}", flush=True)
        data = zdata.load_data(args.data, vocab_size, tokenizer=tokenizer, text_field=args.text_field,
                               data_format=args.data_format, cache_dir=args.data_cache, share=share)  # fmt: skip
        data.check(args.seq_len)
    except ConfigError as e:
        parser().error(str(e))
    return data


def _barrier(name: str) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def _quiet_closed_loops() -> None:
    """TensorStore's callbacks into the event loop of an orbax save that failed (a full disk)
    each report "RuntimeError: Event loop is closed" as an unraisable exception, from C, after
    the loop is gone: dropped (the failure itself is reported in one line); the rest as before."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
            return
        previous(unraisable)

    sys.unraisablehook = hook


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _quiet_closed_loops()
    from zoo.runtime import retain_host_memory

    retain_host_memory()  # before JAX starts its threads: no page faults on every step's temporaries
    from zoo import train as ztrain
    from zoo.errors import ConfigError

    if args.wandb:
        try:
            ztrain.metrics.require_wandb()
        except ConfigError as e:
            parser().error(str(e))
    try:  # before any compiling: a run dir in use, or holding a run that is neither resumed nor replaced
        ztrain.check_run_dir(args.run_dir, resume=args.resume, overwrite=args.overwrite)
    except ztrain.RunDirError as e:
        parser().error(str(e))
    if args.save_hf:
        check_save_hf(args)
    import jax

    if args.cpu_devices:
        if "JAX_PLATFORMS" not in os.environ:  # (jax read the environment when zoo imported it)
            jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import jax.numpy as jnp

    import zoo
    from zoo import parallel

    # Before anything touches a device: jax.distributed must start before the backends do, and
    # XLA's pinned host pool is sized before the GPU backend starts.
    size_host_pool(args)
    parallel.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    generation = {}
    mesh = None
    if args.mesh or jax.process_count() > 1:
        try:
            mesh = parallel.make_mesh(args.mesh)
        except zoo.MeshError as e:
            parser().error(f"--mesh: {e}")
        if jax.process_count() > 1:
            print(f"process {jax.process_index()} of {jax.process_count()}: its devices at mesh {mesh_share(mesh)}",
                  flush=True)  # fmt: skip
        try:  # before anything is built: rows and sequences the mesh cannot split
            ztrain.batch.check_batch_layout(args, mesh)
        except ConfigError as e:
            parser().error(f"--mesh {args.mesh}: {e}")
    from zoo.runtime import reset_resident_peak, resident_memory

    before = reset_resident_peak()
    try:
        model = build_model(args, mesh, dtype[args.param_dtype], dtype[args.compute_dtype])
    except zoo.MeshError as e:  # a dimension the mesh does not divide, named
        parser().error(f"--mesh {args.mesh}: {e}")
    if mesh is not None:  # what this process holds: its devices' shards, never the whole model
        arrays = [x for x in jax.tree.leaves(model) if isinstance(x, jax.Array)]
        mine = sum(s.data.nbytes for x in arrays for s in x.addressable_shards)
        grew = "" if before is None else f"; resident memory grew {(resident_memory()[1] - before) / 2**20:.0f} MiB at most"
        print(f"model built on the mesh: {mine / 2**20:.0f} MiB on this process's devices of "
              f"{sum(x.nbytes for x in arrays) / 2**20:.0f} MiB{grew}", flush=True)  # fmt: skip
    if args.checkpoint:
        if args.save_hf:  # its sampling settings go with the weights; a bad file stops the run before training
            try:
                generation = zoo.hf.pretrained.read_generation_config(args.checkpoint)
            except zoo.CheckpointError as e:
                parser().error(str(e))
    if args.seq_len > model.config.max_position_embeddings:
        parser().error(f"--seq-len {args.seq_len} is beyond the model's max_position_embeddings "
                       f"{model.config.max_position_embeddings}")  # fmt: skip
    if args.placement == "auto":
        plan_placement(args, model, mesh)
    elif args.placement is not None:  # a name or map that does not fit the model, named before anything compiles
        try:
            zoo.placement.resolve(args.placement, model)
        except zoo.placement.PlacementError as e:
            parser().error(f"--placement {args.placement}: {e}")
    data = load_training_data(args, model.config.vocab_size)
    cfg = ztrain.TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum, lr=args.lr,
        microbatches=args.microbatches, virtual_stages=args.virtual_stages, min_lr_ratio=args.min_lr_ratio,
        warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip,
        seed=args.seed, model_options=training_options(model, args), log_every=args.log_every, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
    )  # fmt: skip
    peak = args.peak_tflops * 1e12 if args.peak_tflops else ztrain.matmul_peak_flops(dtype[args.compute_dtype])
    n = model.config.num_params()
    print(
        f"{type(model).__name__} {args.preset if not args.checkpoint else args.checkpoint}: {n / 1e6:.1f}M parameters; "
        f"data {data.source} ({count(data.num_tokens('train'), 'train tokens')}); "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s); matmul peak {peak / 1e12:.2f} TFLOP/s",
        flush=True,
    )
    if args.checkpoint and jax.process_index() == 0:  # eval.py and generate.py on the run dir tokenize as training did
        from zoo.data import copy_tokenizer_files

        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        copy_tokenizer_files(args.checkpoint, args.run_dir)
    try:
        model, history = ztrain.train(
            model, data, cfg, run_dir=args.run_dir, resume=args.resume, overwrite=args.overwrite,
            placement=args.placement, mesh=mesh, param_memory=args.param_memory, opt_memory=args.opt_memory,
            peak_flops=peak, consume=True, wandb=args.wandb, sources=sources(args),
            allow_change=[n for n in args.allow_change.split(",") if n], xla_options=args.xla_options,
            xla_defaults=not args.no_xla_defaults, profile=args.profile,
        )  # fmt: skip
    except ztrain.RunDirError as e:  # a run that started into the dir since the check above
        parser().error(str(e))
    except ztrain.checkpoints.SaveFailed as e:  # a full disk: one line; orbax's unfinished tasks would print pages at exit
        print(f"{parser().prog}: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    except (zoo.CheckpointError, zoo.ConfigError, ztrain.NonFiniteLoss) as e:  # each message names its culprit
        sys.exit(f"{parser().prog}: error: {e}")
    except ztrain.Preempted as e:  # saved at the step reached; 128 + the signal (143: SIGTERM), as a shell reports it
        import signal

        print(f"{parser().prog}: {e}", file=sys.stderr, flush=True)
        sys.exit(128 + signal.Signals[e.signal].value)
    except ztrain.Interrupted as e:
        print(f"{parser().prog}: {e}", file=sys.stderr, flush=True)
        sys.exit(130)
    records = history
    if args.resume and (Path(args.run_dir) / "metrics.jsonl").is_file():  # the whole run's, not this session's
        records = [json.loads(x) for x in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    if vals:
        print(f"validation loss: {vals[0]:.3f} -> {vals[-1]:.3f} (metrics: {args.run_dir}/metrics.jsonl, curve: {args.run_dir}/loss.png)")
    if args.save_hf:  # every process takes part (a sharded model is gathered tensor by tensor); process 0 writes
        zoo.save_pretrained(model, args.save_hf, generation_config=generation or None)
        if jax.process_index() == 0:
            if args.checkpoint:  # the tokenizer goes with the weights
                from zoo.data import copy_tokenizer_files

                copy_tokenizer_files(args.checkpoint, args.save_hf)
            print(f"saved {args.save_hf}")


if __name__ == "__main__":
    main()
