"""A training run set up from ``recipes/train.py``'s settings before anything compiles: simulated
CPU devices, the model built from a preset or loaded from a checkpoint (in place on the mesh),
the checks on it, its data, where the trained model may go, and the lines the recipe prints.

The planner sits above training, so ``--placement auto`` and the pinned host pool sized from
the step's estimate are :mod:`zoo.plan.auto`'s. Errors are ``ConfigError`` (``MeshError`` for a
dimension the mesh does not divide) worded with the recipe's flags: it reports them as usage errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.random as jr
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from zoo import data as zdata
from zoo import parallel
from zoo.core import registry
from zoo.errors import CheckpointError, ConfigError, MeshError
from zoo.hf import hub
from zoo.hf.load import from_pretrained, read_config
from zoo.hf.save import check_save_path, save_pretrained
from zoo.placement import PlacementError, resolve
from zoo.runtime import parse_xla_option, resident_memory
from zoo.train.batch import check_batch_layout
from zoo.train.config import TrainConfig
from zoo.train.profile import check_window

# Optimiser defaults. From scratch: a small model's pretraining rate. With a checkpoint, a
# pretrained model's fine-tuning: TRL's SFTConfig defaults (learning rate 2e-5, no weight decay;
# transformers' Trainer uses 5e-5), which keep what pretraining learned: at 5e-3 a real 135M
# instruct checkpoint's held-out loss went from 1.92 to 11.2 in 5 steps.
PRETRAINING = {"lr": 5e-3, "weight_decay": 0.1}
FINE_TUNING = {"lr": 2e-5, "weight_decay": 0.0}


def default_run_dir(checkpoint: str | None, model_type: str, preset: str) -> str:
    """``runs/MODEL-PRESET`` (``runs/llama-small``), or ``runs/NAME`` for a checkpoint ``.../NAME``."""
    if checkpoint:
        return str(Path("runs") / (Path(checkpoint).resolve().name or "checkpoint"))
    return str(Path("runs") / f"{model_type}-{preset}")


def complete(flags: Any) -> None:
    """``recipes/train.py``'s parsed flags (an ``argparse.Namespace``) checked where argparse
    cannot, and the defaults that follow other flags filled in: learning rate and weight decay
    (from scratch or fine-tuning), run dir, warm-up; ``xla_options`` parsed, ``profile`` a window."""
    for name in ("batch_size", "seq_len", "grad_accum", "steps", "log_every", "eval_every", "checkpoint_every",
                 "keep_checkpoints"):  # fmt: skip
        if getattr(flags, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(flags, name)}")
    if flags.microbatches is not None and flags.microbatches < 1:
        raise ConfigError(f"--microbatches must be >= 1, got {flags.microbatches}")
    if flags.virtual_stages < 1:
        raise ConfigError(f"--virtual-stages must be >= 1, got {flags.virtual_stages}")
    if flags.seq_len < 2:
        raise ConfigError(f"--seq-len must be >= 2 (a next-token loss predicts position t+1 from t), "
                          f"got {flags.seq_len}")  # fmt: skip
    if flags.cpu_devices is not None and flags.cpu_devices < 1:
        raise ConfigError(f"--cpu-devices must be >= 1, got {flags.cpu_devices}")
    for name, value in (FINE_TUNING if flags.checkpoint else PRETRAINING).items():
        if getattr(flags, name) is None:
            setattr(flags, name, value)
    if flags.run_dir is None:  # one per model: a run of another model never lands in this one's directory
        flags.run_dir = default_run_dir(flags.checkpoint, flags.model, flags.preset)
    if flags.checkpoint:  # a hub id ("org/name") that is no local folder: its snapshot, fetched into the hub cache
        try:
            flags.checkpoint = str(hub.resolve(flags.checkpoint))
        except CheckpointError as e:
            raise ConfigError(f"--checkpoint {e}") from None
    try:
        flags.xla_options = dict(parse_xla_option(o) for o in flags.xla_option)
    except ValueError as e:
        raise ConfigError(f"--xla-option: {e}") from None
    try:
        flags.profile = check_window(flags.profile, flags.steps, flags.run_dir)
    except ConfigError as e:
        raise ConfigError(f"--{e}") from None
    if flags.warmup is None:  # a short run gets a short warm-up, so --steps alone is always valid
        flags.warmup = min(20, flags.steps // 10)
    elif flags.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {flags.warmup}")
    elif flags.warmup >= flags.steps:
        raise ConfigError(f"--warmup ({flags.warmup}) must be smaller than --steps ({flags.steps})")


def option_fields() -> dict[str, tuple[type, str | None]]:
    """Every family's training options (``mtp_weight`` ...), each once: its type and help, for a flag."""
    out: dict[str, tuple[type, str | None]] = {}
    for family in registry.families():
        for f in dataclasses.fields(family.training_options):
            kind = float if isinstance(f.default, float) or f.default is None else type(f.default)
            out.setdefault(f.name, (kind, f.metadata.get("help")))
    return out


def train_config(flags: Any, model: Any) -> TrainConfig:
    """The run's :class:`TrainConfig` from the flags of its fields, with the model family's
    training options from those given (unset: the family's defaults)."""
    options = type(model).training_options
    given = {f.name: getattr(flags, f.name) for f in dataclasses.fields(options)
             if getattr(flags, f.name, None) is not None}  # fmt: skip
    fields = {f.name: getattr(flags, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(flags, f.name)}
    return TrainConfig(**fields, model_options=options(**given))


def use_cpu_devices(n: int) -> None:
    """Simulate ``n`` CPU devices (on CPU unless ``JAX_PLATFORMS`` says otherwise), before the backend starts."""
    if "JAX_PLATFORMS" not in os.environ:  # (jax read the environment when zoo imported it)
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def preset_config(model_type: str, preset: str, attention: str) -> Any:
    """The config of ``--model``'s ``--preset`` with ``--attention``'s path."""
    family = registry.by_model_type(model_type, "--model")
    return dataclasses.replace(family.config_cls.preset(preset, model_type), attention=attention)


def run_config(checkpoint: str | None, model_type: str, preset: str, attention: str) -> Any:
    """The config the run's model will have: the checkpoint's, else the preset's (``--attention`` set)."""
    if checkpoint:
        return dataclasses.replace(read_config(checkpoint)[1], attention=attention)
    return preset_config(model_type, preset, attention)


def build_model(*, checkpoint: str | None, model_type: str, preset: str, attention: str, seed: int, mesh: Any,
                param_dtype: Any, compute_dtype: Any) -> Any:  # fmt: skip
    """The model of ``checkpoint`` or of ``model_type``'s ``preset``, made in place on ``mesh``
    where there is one: each process reads or initialises only its devices' shards. A preset
    with one multi-token-prediction layer (DeepSeek-V3's) trains it."""
    if checkpoint:
        return from_pretrained(checkpoint, dtype=param_dtype, compute_dtype=compute_dtype, attention=attention,
                               mesh=mesh)  # fmt: skip
    config = preset_config(model_type, preset, attention)
    if getattr(config, "num_nextn_predict_layers", 0) == 1:
        config = dataclasses.replace(config, mtp=True)
    cls = registry.by_model_type(model_type, "--model")
    return cls(config, key=jr.key(seed), mesh=mesh, param_dtype=param_dtype, compute_dtype=compute_dtype)


def make_mesh(spec: str, batch: Any) -> Mesh | None:
    """The run's mesh: ``--mesh``'s, over every process's devices (``None`` for one process and
    no spec); with many processes, where this one's devices sit on it, said in a line. A batch
    the mesh cannot split (``batch.batch_size``, ``batch.seq_len``) is refused before anything is built."""
    if not spec and jax.process_count() == 1:
        check_pipeline_flags(batch, spec, None)
        return None
    try:
        mesh = parallel.make_mesh(spec)
    except MeshError as e:
        raise ConfigError(f"--mesh: {e}") from None
    if jax.process_count() > 1:
        print(f"process {jax.process_index()} of {jax.process_count()}: its devices at mesh {mesh_share(mesh)}",
              flush=True)  # fmt: skip
    check_pipeline_flags(batch, spec, mesh)
    try:  # rows and sequences the mesh cannot split
        check_batch_layout(batch, mesh)
    except ConfigError as e:
        raise ConfigError(f"--mesh {spec}: {e}") from None
    return mesh


def check_pipeline_flags(flags: Any, spec: str, mesh: Mesh | None) -> None:
    """``--microbatches`` and ``--virtual-stages`` only with a pipeline axis in ``--mesh`` (``spec``):
    without one they would mean nothing, yet be kept in the run's settings (``run.json``), where
    a resume without them is refused as a change."""
    if mesh is not None and mesh.shape.get(parallel.PIPELINE, 1) > 1:
        return
    for flag, value, unset in (("microbatches", flags.microbatches, None), ("virtual-stages", flags.virtual_stages, 1)):
        if value != unset:
            raise ConfigError(f"--{flag} needs a pipeline axis in --mesh (e.g. --mesh pipeline=2,...); "
                              f"{f'--mesh {spec}' if spec else 'no --mesh'} has none")  # fmt: skip


def built_on_mesh(model: Any, resident_before: int | None) -> str:
    """What this process holds of a model built on a mesh: its devices' shards, never the whole
    model; and how much its resident memory grew at most (given what it was before the build)."""
    arrays = [x for x in jax.tree.leaves(model) if isinstance(x, jax.Array)]
    mine = sum(s.data.nbytes for x in arrays for s in x.addressable_shards)
    grew = "" if resident_before is None else (
        f"; resident memory grew {(resident_memory()[1] - resident_before) / 2**20:.0f} MiB at most")
    return (f"model built on the mesh: {mine / 2**20:.0f} MiB on this process's devices of "
            f"{sum(x.nbytes for x in arrays) / 2**20:.0f} MiB{grew}")  # fmt: skip


def check_model(model: Any, *, seq_len: int, placement: str | None, mesh: Any = None, virtual_stages: int = 1) -> None:
    """``--seq-len`` within the model's positions, ``--virtual-stages`` chunks that divide each
    pipeline stage's layers (and a layer pattern the family can pipeline so), and a
    ``--placement`` (name or map, not ``auto``) that fits the model, named before anything
    compiles or a run dir is written."""
    if seq_len > model.config.max_position_embeddings:
        raise ConfigError(f"--seq-len {seq_len} is beyond the model's max_position_embeddings "
                          f"{model.config.max_position_embeddings}")  # fmt: skip
    if mesh is not None:
        try:
            parallel.validate_mesh(mesh, model.config, virtual_stages=virtual_stages)
        except MeshError as e:
            raise ConfigError(f"--virtual-stages {virtual_stages}: {e}" if virtual_stages > 1 else str(e)) from None
    if placement not in (None, "auto"):
        try:
            resolve(placement, model)
        except PlacementError as e:
            raise ConfigError(f"--placement {placement}: {e}") from None


def mesh_share(mesh: Any) -> str:
    """Where this process's devices sit on ``mesh``: the indices they take on each axis over 1
    (``pipeline 1, fsdp 0-3``): a multi-host layout is checked at a glance."""
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


def describe(model: Any, name: str, data: Any, peak_flops: float) -> str:
    """The run in a line: model, size, data, devices and the matmul peak MFU is quoted against."""
    return (f"{type(model).__name__} {name}: {model.config.num_params() / 1e6:.1f}M parameters; "
            f"data {data.source} ({count(data.num_tokens('train'), 'train tokens')}); {jax.device_count()} "
            f"{jax.devices()[0].platform} device(s); matmul peak {peak_flops / 1e12:.2f} TFLOP/s")  # fmt: skip


def epochs(data: Any, cfg: Any) -> str | None:
    """How often the run goes through its training data, in a line, where it is more than once
    (a small set is cycled without a word otherwise; ``None`` where the run sees it at most once):
    packed rows per epoch for packed documents, tokens for a token stream."""
    drawn = cfg.steps * cfg.grad_accum * cfg.batch_size  # rows
    if hasattr(data, "plan"):  # packed documents: every row once per epoch
        have, what = data.plan(cfg.seq_len, "train").num_rows, f"rows of {cfg.seq_len} tokens"
    else:  # windows drawn at random offsets: tokens
        have, what, drawn = data.num_tokens("train"), "tokens", drawn * cfg.seq_len
    if drawn <= have:
        return None
    return (f"data: the run takes {count(drawn, what)} ({cfg.steps} steps x {cfg.grad_accum * cfg.batch_size} rows) "
            f"from a train split of {count(have, what)}: about {drawn / have:,.1f} epochs, each row seen that often "
            "(more data, or fewer --steps, to see it less)")  # fmt: skip


def check_save_hf(target: str, *, checkpoint: str | None, run_dir: str) -> None:
    """``--save-hf``: a directory the trained model can go to, known before the first step: not a
    file, not under one, not the checkpoint being fine-tuned (its base weights would be
    replaced) and not the run dir."""
    where = Path(target).resolve()
    try:
        check_save_path(where)
    except CheckpointError as e:
        raise ConfigError(f"--save-hf {target}: {e}") from None
    if checkpoint and where == Path(checkpoint).resolve():
        raise ConfigError(f"--save-hf {target} is the --checkpoint being fine-tuned: saving there would replace its "
                          "base weights; choose another directory")  # fmt: skip
    if where == Path(run_dir).resolve():
        raise ConfigError(f"--save-hf {target} is the --run-dir; choose another directory "
                          f"(e.g. {Path(run_dir) / 'hf'})")  # fmt: skip


def sources(data: str, checkpoint: str | None, text_field: str, data_format: str) -> dict[str, str | None]:
    """What the run is made from, as ``run.json`` keeps it (paths resolved, so that the same
    file named another way is the same source)."""

    def resolved(name: str | None) -> str | None:
        if name is None:
            return None
        return ",".join(str(Path(n).resolve()) if Path(n).exists() else n for n in name.split(","))

    return {"data": resolved(data), "checkpoint": resolved(checkpoint), "text_field": text_field,
            "data_format": data_format}  # fmt: skip


def load_training_data(spec: str, vocab_size: int, *, checkpoint: str | None, seq_len: int, text_field: str = "text",
                       data_format: str = "auto", cache_dir: str | None = None) -> Any:  # fmt: skip
    """The data of ``--data``, tokenized with the checkpoint's tokenizer.json (bytes without one);
    says which tokenizer it uses. Data that cannot fill a row of ``seq_len`` is a ``ConfigError``."""
    # Many processes split the tokenizing (each its share of the records) and all read the
    # merged cache entry (zoo.data.Share); the cache directory is shared in a cluster.
    share = None
    if jax.process_count() > 1:
        share = zdata.Share(jax.process_index(), jax.process_count(), multihost_utils.sync_global_devices)
    tokenizer = zdata.load_tokenizer(checkpoint)
    print(f"tokenizer: {tokenizer.describe()}", flush=True)
    data = zdata.load_data(spec, vocab_size, tokenizer=tokenizer, text_field=text_field, data_format=data_format,
                           cache_dir=cache_dir, share=share)  # fmt: skip
    data.check(seq_len)
    return data


def copy_tokenizer(checkpoint: str | None, target: str) -> None:
    """The checkpoint's tokenizer files next to what a run writes from it (process 0 only), so
    recipes reading ``target`` tokenize as training did."""
    if checkpoint and jax.process_index() == 0:
        Path(target).mkdir(parents=True, exist_ok=True)
        zdata.copy_tokenizer_files(checkpoint, target)


def validation_summary(run_dir: str, history: Sequence[dict], resume: bool) -> str | None:
    """The run's first and last validation loss, the whole run's (``metrics.jsonl``) when resumed."""
    records = list(history)
    metrics = Path(run_dir) / "metrics.jsonl"
    if resume and metrics.is_file():  # the whole run's, not this session's
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    if not vals:
        return None
    return (f"validation loss: {vals[0]:.3f} -> {vals[-1]:.3f} (metrics: {run_dir}/metrics.jsonl, "
            f"curve: {run_dir}/loss.png)")  # fmt: skip


def save_hf(model: Any, target: str, *, checkpoint: str | None, generation: dict | None) -> None:
    """The trained model as a Hugging Face checkpoint in ``target``, with the fine-tuned
    checkpoint's sampling settings and tokenizer. Every process takes part (a sharded model is
    gathered tensor by tensor); process 0 writes and says so."""
    save_pretrained(model, target, generation_config=generation or None)
    copy_tokenizer(checkpoint, target)
    if jax.process_index() == 0:
        print(f"saved {target}")
