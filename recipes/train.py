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
import os
import signal
import sys

import jax
import jax.numpy as jnp
import jax.random as jr

from zoo import lora, parallel, runtime
from zoo import train as ztrain
from zoo.cli import Help, positive
from zoo.core import registry
from zoo.errors import CheckpointError, ConfigError, MeshError
from zoo.hf.load import read_generation_config
from zoo.lora import formats, quantized
from zoo.placement import PlacementError
from zoo.plan import auto
from zoo.train import setup
from zoo.train.setup import FINE_TUNING, PRETRAINING

MODELS = tuple(registry.model_types())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=MODELS, default="llama", help="model type (default llama)")
    m.add_argument("--preset", default="small", help="config preset, e.g. small, tiny, bench, llama3.1-8b (default small)")
    m.add_argument("--checkpoint", help="a Hugging Face checkpoint directory, or hub id (org/name; fetched into the hub cache), to "
                        "fine-tune (overrides --model/--preset)")  # fmt: skip
    m.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32", help="activation dtype")
    m.add_argument("--precision", default=None,
                   help="which matmuls run in FP8: the family's precision map as a preset (fp8_all: tensorwise current "
                        "scaling, mxfp8, blockwise; deepseek for --model deepseek_v3) or 'preset+name=recipe,...' "
                        "(docs/precision.md); default: none")  # fmt: skip
    m.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32", help="parameter dtype")
    m.add_argument("--attention", choices=["auto", "xla", "blockwise", "cudnn", "splash", "pallas_gpu"], default="auto",
                   help="attention path: auto picks splash (TPU), cuDNN (GPU, bf16, unpacked), the Pallas GPU kernel "
                        "(GPU, bf16, packed), blockwise (long sequences, context parallelism) or dense XLA "
                        "(see docs/models.md)")  # fmt: skip
    m.add_argument("--capacity-factor", type=positive, default=None,
                   help="MoE expert parallelism: each all-to-all round's slot per destination, x the mean routed rows "
                        "(default: the config's, 1.25; see docs/parallelism.md)")  # fmt: skip
    m.add_argument("--moe-overflow", choices=["dropless", "drop"], default=None,
                   help="MoE: past a round's slots, more rounds (dropless, the default: exact) or token dropping "
                        "(dropped pairs counted and logged)")  # fmt: skip
    m.add_argument("--moe-transport", choices=["auto", "padded", "ragged"], default=None,
                   help="MoE expert parallelism: how a round's rows travel; auto (default): ragged all-to-alls "
                        "(only the routed rows) on GPU and TPU, padded (every slot) elsewhere")  # fmt: skip
    d = p.add_argument_group("data")
    d.add_argument("--data", default="stdlib",
                   help="'stdlib' (embedded), a .npy token file, or comma-separated text files, JSON lines (.jsonl), "
                        "Parquet files, saved Hugging Face dataset directories and hub datasets (hf:NAME[:CONFIG]; see docs/data.md)")  # fmt: skip
    d.add_argument("--text-field", default="text", help="the field of a JSON-lines/Parquet/dataset record that holds its text")
    d.add_argument("--data-format", choices=["auto", "text", "chat", "completion"], default="auto",
                   help="auto: a record with 'messages' is a chat (loss on the assistant's turns), with 'prompt' and "
                        "'completion' a pair (loss on the completion), else text")  # fmt: skip
    d.add_argument("--data-cache", default=None, help="where tokenized data is cached (default $ZOO_CACHE_DIR/data or ~/.cache/zoo/data)")
    d.add_argument("--batch-size", type=int, default=16, help="rows of --seq-len tokens per micro-batch")
    d.add_argument("--seq-len", type=int, default=128, help="tokens per packed row")
    d.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    d.add_argument("--microbatches", type=int, default=None,
                   help="with a pipeline mesh axis: micro-batches each device's rows are cut into and passed through "
                        "the stages (default: one per stage; more shrink the bubble (P-1)/(M+P-1))")  # fmt: skip
    d.add_argument("--virtual-stages", type=int, default=1,
                   help="with a pipeline mesh axis: the interleaved schedule, each stage's layers in V chunks "
                        "(bubble (P-1)/(V*M+P-1); --microbatches a multiple of the stages; default 1: GPipe)")  # fmt: skip
    d.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe",
                   help="with a pipeline mesh axis: gpipe (every stage keeps all M micro-batches' saved tensors until "
                        "the backward pass) or 1f1b (each micro-batch's backward pass as soon as it leaves the last "
                        "stage: at most 2P-1 kept, whatever M; same bubble and numerics; with --virtual-stages, interleaved 1F1B)")  # fmt: skip
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=250, help="optimizer steps")
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
    for name, (kind, text) in setup.option_fields().items():  # every family's training options; unset: its defaults
        o.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=text)
    x = p.add_argument_group("memory and parallelism")
    x.add_argument("--placement", default=None,
                   help="activation placement: a preset name, 'name=where,...' (see docs/placement.md), or 'auto': "
                        "zoo.plan's fastest map within the device budget, with parameter and optimizer memory")  # fmt: skip
    x.add_argument("--param-memory", choices=["device", "pinned_host"], default="device",
                   help="where the parameters live between steps")  # fmt: skip
    x.add_argument("--opt-memory", choices=["device", "pinned_host"], default="device",
                   help="where the optimizer state lives between steps")  # fmt: skip
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
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --run-dir (default: --model/--preset's, not the latest run of any "
                          "model) from its latest good checkpoint")  # fmt: skip
    run.add_argument("--overwrite", action="store_true",
                     help="remove a previous run's metrics, checkpoints and loss.png from --run-dir first")  # fmt: skip
    r.add_argument("--allow-change", default="", metavar="NAMES",
                   help="--resume: settings the resumed run may change, comma-separated (e.g. lr,steps); any other "
                        "difference from the run's run.json is refused, listed (docs/training.md, Resuming)")  # fmt: skip
    r.add_argument("--log-every", type=int, default=25, help="steps between metric lines")
    r.add_argument("--eval-every", type=int, default=50, help="steps between validation losses")
    r.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    r.add_argument("--keep-checkpoints", type=int, default=3, help="how many recent checkpoints to keep (>= 1)")
    r.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: measured matmul peak)")
    r.add_argument("--profile", default=None, metavar="START:STOP",
                   help="trace steps START..STOP-1 (the first step is 1) into RUN_DIR/profile; read it with "
                        "python recipes/profile.py RUN_DIR (docs/placement.md, Reading the profile)")  # fmt: skip
    r.add_argument("--save-hf", default=None,
                   help="also write the trained model as a Hugging Face checkpoint here (an empty or new directory, "
                        "or this run's own earlier export when resumed)")  # fmt: skip
    r.add_argument("--lora", default=None, metavar="r=R,alpha=A[,dropout=P][,rslora][,targets=NAME,...]",
                   help="train LoRA adapters only, the model frozen: rank, alpha (scale alpha/r; rsLoRA alpha/sqrt(r)), "
                        "dropout on the adapters' inputs while training (PEFT's lora_dropout, default 0), "
                        "targets as PEFT names modules (default all-linear: every linear weight but the head); "
                        "--save-hf then writes the merged model")  # fmt: skip
    r.add_argument("--save-adapter", default=None, metavar="DIR",
                   help="with --lora: also write the adapters here in PEFT's format (adapter_config.json, "
                        "adapter_model.safetensors)")  # fmt: skip
    r.add_argument("--qlora", default=None, choices=sorted(formats.QUANTIZED),
                   help="with --lora: QLoRA, the frozen model's layer stacks stored quantized as bitsandbytes stores "
                        "them (nf4: 4-bit NormalFloat with double quantization; int8: row-wise absmax, LLM.int8), "
                        "or fp8 (E4M3 with a scale per 128x128 tile, as DeepSeek-V3's checkpoint: an FP8 "
                        "checkpoint's own codes kept), dequantized a layer at a time in the step")  # fmt: skip
    r.add_argument("--overwrite-hf", action="store_true",
                   help="--save-hf may replace what the directory holds (another run's export)")
    r.add_argument("--wandb", metavar="PROJECT", default=None,
                   help="also log to this Weights & Biases project (needs wandb; WANDB_MODE=offline logs without an "
                        "account, files in RUN_DIR/wandb)")  # fmt: skip
    return p


def parse_lora(text: str) -> lora.LoraConfig:
    """``--lora``'s value: ``r=16,alpha=32[,dropout=0.05][,rslora][,targets=q_proj,v_proj]``
    (the names after ``targets=`` run to the end)."""
    fields: dict[str, object] = {"targets": (lora.ALL_LINEAR,)}
    parts = [x.strip() for x in text.split(",") if x.strip()]
    for i, part in enumerate(parts):
        key, _, value = part.partition("=")
        if key == "targets":
            fields["targets"] = (value, *parts[i + 1 :])
            break
        if key == "rslora" and not value:
            fields["rslora"] = True
        elif key in ("r", "alpha", "dropout") and value:
            try:
                fields[key] = int(value) if key == "r" else float(value)
            except ValueError:
                raise ConfigError(f"--lora {key}={value!r}: not a number") from None
        else:
            raise ConfigError(f"--lora: {part!r} is not one of r=, alpha=, dropout=, rslora, targets=")
    if "r" not in fields or "alpha" not in fields:
        raise ConfigError(f"--lora {text!r}: r= and alpha= are needed")
    return lora.LoraConfig(**fields)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    try:
        args.lora = None if args.lora is None else parse_lora(args.lora)
        for flag in ("save_adapter", "qlora"):
            if getattr(args, flag) and args.lora is None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --lora")
        setup.complete(args)
    except ConfigError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.resume:  # which run: --run-dir's, by default --model/--preset's, not the latest of any model
        print(ztrain.run_dir.resume_target(args), flush=True)
    ztrain.checkpoints.quiet_closed_loops()
    runtime.retain_host_memory()  # before JAX starts its threads: no page faults on every step's temporaries
    try:
        if args.wandb:
            ztrain.metrics.require_wandb()
        # before any compiling: a run dir in use, or holding a run that is neither resumed nor replaced
        ztrain.check_run_dir(args.run_dir, resume=args.resume, overwrite=args.overwrite)
        if args.save_hf:
            setup.check_save_hf(args.save_hf, checkpoint=args.checkpoint, run_dir=args.run_dir, resume=args.resume,
                                overwrite_hf=args.overwrite_hf)  # fmt: skip
    except (ConfigError, ztrain.RunDirError) as e:
        parser().error(str(e))
    if args.cpu_devices:
        setup.use_cpu_devices(args.cpu_devices)
    # Before anything touches a device: jax.distributed must start before the backends do, and
    # XLA's pinned host pool is sized before the GPU backend starts.
    try:
        auto.size_host_pool_from_flags(args)
    except (CheckpointError, ConfigError, MeshError, PlacementError) as e:
        parser().error(str(e))
    parallel.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    try:
        mesh = setup.make_mesh(args.mesh, args)  # before anything is built: rows the mesh cannot split, named
        before = runtime.reset_resident_peak()
        model = setup.build_model(checkpoint=args.checkpoint, model_type=args.model, preset=args.preset,
                                  attention=args.attention, seed=args.seed, mesh=mesh, moe=setup.moe_settings(args),
                                  param_dtype=dtype[args.param_dtype], compute_dtype=dtype[args.compute_dtype],
                                  quantized=args.qlora if args.lora is not None else None)  # fmt: skip
    except MeshError as e:  # a dimension the mesh does not divide, named
        parser().error(f"--mesh {args.mesh}: {e}")
    except (CheckpointError, ConfigError) as e:
        parser().error(str(e))
    if mesh is not None:  # what this process holds: its devices' shards, never the whole model
        print(setup.built_on_mesh(model, before), flush=True)
    try:  # the checkpoint's sampling settings go with the saved weights; a bad file stops the run before training
        generation = read_generation_config(args.checkpoint) if args.checkpoint and args.save_hf else {}
        setup.check_model(model, seq_len=args.seq_len, placement=args.placement, mesh=mesh,
                          virtual_stages=args.virtual_stages, precision=args.precision)  # fmt: skip
    except (CheckpointError, ConfigError) as e:
        parser().error(str(e))
    if args.lora is not None:  # the adapters on the built model; the same seed on a resume: the same tree
        try:  # before quantizing: what LoRA cannot run on (a mesh), named
            lora.check_trainable(lora.LoraModel(base=model, adapters={}, lora=args.lora), mesh=mesh)
        except ConfigError as e:
            parser().error(f"--lora: {e}")
        if args.qlora:
            try:  # (a checkpoint was quantized as it was read: build_model)
                model = model if quantized.formats(model) else formats.QUANTIZED[args.qlora].quantize_model(model)
            except ConfigError as e:
                parser().error(f"--qlora {args.qlora}: {e}")
            print(f"QLoRA: the layer stacks in {args.qlora}, the model {quantized.nbytes(model) / 2**20:,.1f} MiB",
                  flush=True)  # fmt: skip
        try:
            model = lora.init(model, args.lora, key=jr.fold_in(jr.key(args.seed), 41))
        except ConfigError as e:
            parser().error(f"--lora: {e}")
        n = sum(x.size for x in jax.tree.leaves(model.adapters))
        print(f"LoRA: r={args.lora.r} alpha={args.lora.alpha:g} scale={args.lora.scale:g} on {len(model.adapters)} "
              f"weights ({', '.join(model.adapters)}): {n:,} trainable parameters", flush=True)  # fmt: skip
    if args.placement == "auto":
        try:
            result = auto.plan_placement(model, mesh, seq_len=args.seq_len, batch_size=args.batch_size,
                                         virtual_stages=args.virtual_stages, hardware=args.hardware,
                                         device_budget_gib=args.device_budget_gib)  # fmt: skip
        except (ConfigError, MeshError) as e:
            parser().error(f"--placement auto: {e}")
        args.placement, args.param_memory, args.opt_memory = result.placement, result.param_memory, result.opt_memory
    try:
        data = setup.load_training_data(args.data, model.config.vocab_size, checkpoint=args.checkpoint,
                                        seq_len=args.seq_len, text_field=args.text_field,
                                        data_format=args.data_format, cache_dir=args.data_cache)  # fmt: skip
    except ConfigError as e:
        parser().error(str(e))
    cfg = setup.train_config(args, lora.base_model(model))
    peak = args.peak_tflops * 1e12 if args.peak_tflops else ztrain.matmul_peak_flops(dtype[args.compute_dtype])
    name = args.checkpoint_id or args.checkpoint or args.preset
    print(setup.describe(lora.base_model(model), name, data, peak), flush=True)
    if cycled := setup.epochs(data, cfg):  # a small set is repeated: said, with how often
        print(cycled, flush=True)
    setup.copy_tokenizer(args.checkpoint, args.run_dir)  # eval.py and generate.py on the run dir tokenize as training did
    try:
        model, history = ztrain.train(
            model, data, cfg, run_dir=args.run_dir, resume=args.resume, overwrite=args.overwrite,
            placement=args.placement, mesh=mesh, param_memory=args.param_memory, opt_memory=args.opt_memory,
            peak_flops=peak, consume=True, wandb=args.wandb,
            sources=setup.sources(args.data, args.checkpoint, args.text_field, args.data_format,
                                  checkpoint_id=args.checkpoint_id),
            allow_change=[n for n in args.allow_change.split(",") if n], xla_options=args.xla_options,
            xla_defaults=not args.no_xla_defaults, profile=args.profile,
        )  # fmt: skip
    except ztrain.RunDirError as e:  # a run that started into the dir since the check above
        parser().error(str(e))
    except ztrain.checkpoints.SaveFailed as e:  # a full disk: one line; orbax's unfinished tasks would print pages at exit
        print(f"{parser().prog}: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    except (CheckpointError, ConfigError, MeshError, ztrain.NonFiniteLoss) as e:  # each message names its culprit
        sys.exit(f"{parser().prog}: error: {e}")
    except ztrain.Preempted as e:  # saved at the step reached; 128 + the signal (143: SIGTERM), as a shell reports it
        print(f"{parser().prog}: {e}", file=sys.stderr, flush=True)
        sys.exit(128 + signal.Signals[e.signal].value)
    except ztrain.Interrupted as e:
        print(f"{parser().prog}: {e}", file=sys.stderr, flush=True)
        sys.exit(130)
    summary = setup.validation_summary(args.run_dir, history, args.resume)
    if summary:
        print(summary)
    if args.save_adapter:
        lora.save_adapter(model, args.save_adapter, base_model_name_or_path=args.checkpoint_id or args.checkpoint)
        print(f"LoRA adapters written to {args.save_adapter} (PEFT format)", flush=True)
    if args.save_hf and args.lora is not None:
        model = lora.merge(model)  # the adapters folded into the weights: a plain checkpoint
    if args.save_hf:  # every process takes part (a sharded model is gathered tensor by tensor); process 0 writes
        setup.save_hf(model, args.save_hf, checkpoint=args.checkpoint, generation=generation, run_dir=args.run_dir)


if __name__ == "__main__":
    main()
