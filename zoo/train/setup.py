"""A training run set up from ``recipes/train.py``'s settings before anything compiles: simulated
CPU devices, the model built from a preset or loaded from a checkpoint (in place on the mesh),
the checks on it and the lines the recipe prints; its data (:mod:`zoo.train.run_data`) and
where the trained model may go (:mod:`zoo.train.export`) are re-exported from here.

The planner sits above training, so ``--placement auto`` and the pinned host pool sized from
the step's estimate are :mod:`zoo.plan.auto`'s. Errors are ``ConfigError`` (``MeshError`` for a
dimension the mesh does not divide) worded with the recipe's flags: it reports them as usage errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.random as jr
import numpy as np
from jax.sharding import Mesh

from zoo import parallel
from zoo.core import registry
from zoo.errors import CheckpointError, ConfigError, MeshError
from zoo.hf import hub
from zoo.hf.load import from_pretrained, read_config
from zoo.layers import precision as zoo_precision
from zoo.lora import formats
from zoo.placement import PlacementError, resolve
from zoo.runtime import parse_xla_option, resident_memory
from zoo.train.batch import check_batch_layout
from zoo.train.config import TrainConfig
from zoo.train.export import check_save_hf, copy_tokenizer, save_hf, validation_summary  # noqa: F401  (recipes/train.py's)
from zoo.train.profile import check_window
from zoo.train.run_data import count, epochs, load_training_data, sources  # noqa: F401  (recipes/train.py's)
from zoo.train.run_dir import default_run_dir

# Optimiser defaults. From scratch: a small model's pretraining rate. With a checkpoint, a
# pretrained model's fine-tuning: TRL's SFTConfig defaults (learning rate 2e-5, no weight decay;
# transformers' Trainer uses 5e-5), which keep what pretraining learned: at 5e-3 a real 135M
# instruct checkpoint's held-out loss went from 1.92 to 11.2 in 5 steps.
PRETRAINING = {"lr": 5e-3, "weight_decay": 0.1}
FINE_TUNING = {"lr": 2e-5, "weight_decay": 0.0}
# LoRA adapters (``--lora``): the rate of PEFT's and the QLoRA paper's recipes (2e-4), ten times a
# full fine-tune's: only the small adapters move, from B = 0.
LORA = {"lr": 2e-4, "weight_decay": 0.0}


def complete(flags: Any) -> None:
    """``recipes/train.py``'s parsed flags (an ``argparse.Namespace``) checked where argparse
    cannot, and the defaults that follow other flags filled in: learning rate and weight decay
    (from scratch, fine-tuning or LoRA), run dir, warm-up; ``xla_options`` parsed, ``profile`` a window."""
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
    if getattr(flags, "overwrite_hf", False) and not flags.save_hf:
        raise ConfigError("--overwrite-hf needs --save-hf DIR (the export it lets replace)")
    defaults = LORA if getattr(flags, "lora", None) is not None else FINE_TUNING if flags.checkpoint else PRETRAINING
    for name, value in defaults.items():
        if getattr(flags, name) is None:
            setattr(flags, name, value)
    if flags.run_dir is None:  # one per model: a run of another model never lands in this one's directory
        flags.run_dir = default_run_dir(flags.checkpoint, flags.model, flags.preset)
    # A hub id ("org/name") that is no local folder: its snapshot, fetched into the hub cache; the id
    # as given is kept (``checkpoint_id``) for run.json and the lines that name the run's source.
    flags.checkpoint_id = None
    if flags.checkpoint:
        try:
            given, flags.checkpoint = flags.checkpoint, str(hub.resolve(flags.checkpoint))
        except CheckpointError as e:
            raise ConfigError(f"--checkpoint {e}") from None
        if hub.is_hub_id(given) and not Path(given).exists():
            flags.checkpoint_id = given
    try:
        flags.xla_options = dict(parse_xla_option(o) for o in flags.xla_option)
    except ValueError as e:
        raise ConfigError(f"--xla-option: {e}") from None
    try:
        flags.profile = check_window(flags.profile, flags.steps, flags.run_dir)
    except ConfigError as e:
        raise ConfigError(f"--{e}") from None
    if flags.warmup is None and flags.resume:  # a resume keeps its run's warm-up (the default follows --steps)
        flags.warmup = _recorded_warmup(flags.run_dir)
    if flags.warmup is None:  # a short run gets a short warm-up, so --steps alone is always valid
        flags.warmup = min(20, flags.steps // 10)
    elif flags.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {flags.warmup}")
    elif flags.warmup >= flags.steps:
        raise ConfigError(f"--warmup ({flags.warmup}) must be smaller than --steps ({flags.steps})")


def _recorded_warmup(run_dir: str) -> int | None:
    """The warm-up the run in ``run_dir`` was made with (its ``run.json``), or None."""
    try:
        warmup = json.loads((Path(run_dir) / "run.json").read_text())["train"]["warmup"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no run yet, or one check_resume will describe
    return warmup if isinstance(warmup, int) else None


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


# The MoE dispatch's flags (zoo.layers.moe_dispatch), each a config field of the MoE families.
MOE_FLAGS = {"capacity_factor": "--capacity-factor", "moe_overflow": "--moe-overflow", "moe_transport": "--moe-transport"}


def moe_settings(flags: Any) -> dict[str, Any]:
    """The MoE dispatch settings the flags give (those left unset keep the config's defaults)."""
    return {name: v for name in MOE_FLAGS if (v := getattr(flags, name, None)) is not None}


def build_model(*, checkpoint: str | None, model_type: str, preset: str, attention: str, seed: int, mesh: Any,
                param_dtype: Any, compute_dtype: Any, moe: Mapping[str, Any] | None = None,
                quantized: str | None = None) -> Any:  # fmt: skip
    """The model of ``checkpoint`` or of ``model_type``'s ``preset``, made in place on ``mesh``
    where there is one: each process reads or initialises only its devices' shards. A preset
    with one multi-token-prediction layer (DeepSeek-V3's) trains it. ``moe``: the dispatch
    settings (:func:`moe_settings`), refused for a model without routed experts. ``quantized``
    (``--qlora``: ``"nf4"``, ``"int8"``, ``"fp8"``): a checkpoint's layer stacks quantized on the host as
    they are read, on one device (:func:`zoo.lora.quantized.load_quantized`)."""
    moe = dict(moe or {})
    if moe:
        family = read_config(hub.resolve(checkpoint))[0] if checkpoint else registry.by_model_type(model_type, "--model")
        if not set(moe) <= {f.name for f in dataclasses.fields(family.config_cls)}:
            named = [MOE_FLAGS[f] for f in MOE_FLAGS if f in moe]
            flags = " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
            raise ConfigError(f"{flags}: {family.__name__} has no routed experts to dispatch")
    if checkpoint and quantized and mesh is None:
        load = formats.format_module(quantized).from_pretrained
        return load(checkpoint, dtype=param_dtype, compute_dtype=compute_dtype, attention=attention, **moe)
    if checkpoint:
        return from_pretrained(checkpoint, dtype=param_dtype, compute_dtype=compute_dtype, attention=attention,
                               mesh=mesh, **moe)  # fmt: skip
    config = dataclasses.replace(preset_config(model_type, preset, attention), **moe)
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
    """``--microbatches``, ``--virtual-stages`` and ``--schedule`` only with a pipeline axis in ``--mesh`` (``spec``):
    without one they would mean nothing, yet be kept in the run's settings (``run.json``), where
    a resume without them is refused as a change."""
    if mesh is not None and mesh.shape.get(parallel.PIPELINE, 1) > 1:
        return
    for flag, value, unset in (("microbatches", flags.microbatches, None), ("virtual-stages", flags.virtual_stages, 1),
                               ("schedule", getattr(flags, "schedule", "gpipe"), "gpipe")):  # fmt: skip
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
    # Replicated parameters sit on every device, so the shards can sum to more than the model.
    return (f"model built on the mesh: {sum(x.nbytes for x in arrays) / 2**20:.0f} MiB in all; this process's "
            f"devices hold {mine / 2**20:.0f} MiB of shards (a replicated array once per device){grew}")  # fmt: skip


def check_model(model: Any, *, seq_len: int, placement: str | None, mesh: Any = None, virtual_stages: int = 1,
                precision: str | None = None) -> None:  # fmt: skip
    """``--seq-len`` within the model's positions, ``--virtual-stages`` chunks that split each
    pipeline stage's layers (none empty) (and a layer pattern the family can pipeline so), and a
    ``--placement`` (name or map, not ``auto``) and ``--precision`` that fit the model, named
    before anything compiles or a run dir is written."""
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
    if precision is not None:
        try:
            zoo_precision.resolve(precision, model)
        except ConfigError as e:
            raise ConfigError(f"--precision {precision}: {e}") from None


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


def describe(model: Any, name: str, data: Any, peak_flops: float) -> str:
    """The run in a line: model, size, data, devices and the matmul peak MFU is quoted against."""
    kind = getattr(model.config, "model_type", None)  # a family of several (Qwen3: qwen3, qwen3_moe) says which
    label = f"{type(model).__name__} ({kind})" if isinstance(kind, str) else type(model).__name__
    return (f"{label} {name}: {model.config.num_params() / 1e6:.1f}M parameters; "
            f"data {data.source} ({count(data.num_tokens('train'), 'train tokens')}); {jax.device_count()} "
            f"{jax.devices()[0].platform} device(s); matmul peak {peak_flops / 1e12:.2f} TFLOP/s")  # fmt: skip


