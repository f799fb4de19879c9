"""Verified restores: a training checkpoint is trusted only once its metadata reads, its arrays
fit the model, it restores, every array is finite and matches the bit sums saved with it
(damaged ones are moved aside, never deleted); a resumed run's metrics cut at its step
(``truncate_metrics``); and a run directory's model at its latest good checkpoint (``load_run``,
``load_model``: what eval and generate read)."""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, make_single_device_sharding

from zoo import parallel
from zoo.core.params import is_param
from zoo.errors import CheckpointError, ConfigError
from zoo.hf.load import DTYPE_NAMES, from_pretrained, read_config
from zoo.parallel.place import reorder_stacks
from zoo.placement import tree_placement
from zoo.train.checkpoints import _describe, _key_name, _params_first, _short, audit, first_non_finite, named_leaves
from zoo.train.config import TrainConfig, optimizer


def _misfit(saved: Mapping[str, Any], abstract: Any) -> str | None:
    """How a checkpoint's arrays (orbax metadata) differ from the model's, or None."""
    want = named_leaves(abstract)
    for name in _params_first(want):
        leaf = want[name]
        if name not in saved:
            return f"{_describe(name)} {tuple(leaf.shape)} is not in the checkpoint"
        if tuple(saved[name].shape) != tuple(leaf.shape):
            # A mesh that pads the vocabulary or an MLP differently lays the same model out in
            # other shapes (zoo.parallel.layout_sizes): said, so the remedy is plain.
            return (f"{_describe(name)} has shape {tuple(saved[name].shape)} in the checkpoint, "
                    f"{tuple(leaf.shape)} in the model (saved on a mesh that pads it differently? resume on a mesh "
                    "whose axes pad it as the saving run's did, or continue from its --save-hf export)")  # fmt: skip
    extra = _params_first(name for name in saved if name not in want)
    return f"{_describe(extra[0])} is in the checkpoint, not in the model" if extra else None


def _try_restore(manager: Any, step: int, path: Path, abstract: Any, to_device: bool) -> tuple[str | None, Any]:
    """``(None, tree)``, or ``(what is wrong, None)`` for a damaged checkpoint; raises
    ``CheckpointError`` for a checkpoint of another model (falling back would not help)."""
    import orbax.checkpoint as ocp

    try:
        meta = manager.item_metadata(step)
    except Exception as e:  # noqa: BLE001  (orbax and TensorStore raise plain Exceptions for damage)
        return f"its metadata does not read ({_short(e)})", None
    saved = named_leaves(meta) if meta is not None else {}
    if not saved:
        return "its metadata is missing", None
    if (misfit := _misfit(saved, abstract)) is not None:
        raise CheckpointError(f"checkpoint step {step} ({path}) does not fit the model: {misfit} "
                              "(a checkpoint of another preset or model?)")  # fmt: skip
    try:  # the bit sums saved with it, in its _CHECKPOINT_METADATA: without them nothing is verified
        expected = (manager.metadata(step).custom_metadata or {}).get("zoo", {}).get("checksums")
    except Exception as e:  # noqa: BLE001  (orbax raises plain Exceptions, or logs and gives nothing)
        return f"it cannot be verified: its _CHECKPOINT_METADATA does not read ({_short(e)})", None
    if not isinstance(expected, dict) or not expected:
        return "it cannot be verified: its _CHECKPOINT_METADATA (missing, empty or not JSON) holds no checksums", None

    # Restored as saved (a resume that changes --param-dtype: verified first, then cast).
    def as_saved(name: str, x: Any) -> Any:
        if not hasattr(x, "dtype") or name not in saved or np.dtype(saved[name].dtype) == np.dtype(x.dtype):
            return x
        return jax.ShapeDtypeStruct(x.shape, saved[name].dtype, sharding=getattr(x, "sharding", None))

    try:
        tree = manager.restore(step, args=ocp.args.StandardRestore(_tree_map_named(as_saved, abstract)))
    except Exception as e:  # noqa: BLE001  (as above)
        return f"it does not restore ({_short(e)})", None
    finite, sums = audit(tree, to_device=to_device)
    if (bad := first_non_finite(tree, finite)) is not None:
        return f"its {bad} is not finite", None
    got = dict(zip(named_leaves(tree), np.asarray(sums).tolist()))
    for name in _params_first(got):
        if name not in expected:
            return f"it cannot be verified: no checksum was saved for its {_describe(name)}", None
        if int(expected[name]) != got[name]:
            return f"its {_describe(name)} does not match the checksum saved with it", None
    return None, jax.tree.map(lambda x, want: x if x.dtype == want.dtype else x.astype(want.dtype), tree, abstract)


def _tree_map_named(fn: Any, tree: Any) -> Any:
    """``fn(name, leaf)`` over ``tree``'s leaves, each named as :func:`named_leaves` names it."""
    return jax.tree_util.tree_map_with_path(lambda path, x: fn(".".join(map(_key_name, path)), x), tree)


def restore_latest(manager: Any, run_dir: Path, abstract: Any, to_device: bool, *, move_damaged: bool = True
                   ) -> tuple[int, Any]:  # fmt: skip
    """The newest checkpoint that restores and verifies: ``(step, tree)``; ``(0, None)`` if
    there is none. Damaged newer ones are moved to ``run_dir/damaged-checkpoints`` (kept,
    not deleted; ``move_damaged=False``: left in place, for a reader), saying so; with no good
    one left, ``CheckpointError`` names them all."""
    ckpt_dir = run_dir / "checkpoints"
    damaged: list[tuple[int, str]] = []
    for step in sorted(manager.all_steps(), reverse=True):
        problem, tree = _try_restore(manager, step, ckpt_dir / str(step), abstract, to_device)
        if problem is not None:
            damaged.append((step, problem))
            continue
        if not move_damaged:
            for bad, why in damaged:
                print(f"checkpoint step {bad} ({ckpt_dir / str(bad)}) is damaged: {why}; using step {step}",
                      file=sys.stderr, flush=True)  # fmt: skip
            return step, tree
        for bad, why in damaged:
            dest = run_dir / "damaged-checkpoints" / str(bad)
            n = 1
            while dest.exists():
                dest, n = run_dir / "damaged-checkpoints" / f"{bad}.{n}", n + 1
            dest.parent.mkdir(exist_ok=True)
            shutil.move(ckpt_dir / str(bad), dest)  # a later save of this step would collide with it
            print(f"checkpoint step {bad} ({ckpt_dir / str(bad)}) is damaged: {why}; moved it to {dest}; "
                  f"falling back to step {step}", file=sys.stderr, flush=True)  # fmt: skip
        if damaged:
            manager.reload()
        return step, tree
    if damaged:
        raise CheckpointError(
            f"no checkpoint in {ckpt_dir} is usable: "
            + "; ".join(f"step {s} ({ckpt_dir / str(s)}) is damaged: {why}" for s, why in damaged)
            + (
                ". Nothing to resume from: start over with --overwrite"
                if move_damaged
                else ". The run directory is left as it is"
            )
        )
    return 0, None


class _ReadOnlyNotes(logging.Filter):
    """While in use, drops orbax's notes (absl warnings) that the read-only manager a reader
    opens is read-only (``read_only=True, setting create=False``, ``Given directory is read
    only``): noise on every eval and generate of a run dir. Every other record passes."""

    NOTES = ("CheckpointManagerOptions.read_only=True, setting", "Given directory is read only")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(str(record.msg).startswith(n) for n in self.NOTES)

    def __enter__(self) -> None:
        logging.getLogger("absl").addFilter(self)

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("absl").removeFilter(self)


def truncate_metrics(path: Path, step: int) -> list[dict[str, Any]]:
    """Keep the records of steps up to ``step`` (none when 0: the run starts over), rewritten
    atomically; returns them. A resumed run then appends, and no step is logged twice."""
    if not path.is_file():
        return []
    kept, lines = [], []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if step > 0 and isinstance(record, dict) and record.get("step", math.inf) <= step:
            kept.append(record)
            lines.append(line)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(x + "\n" for x in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return kept


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` is a training run directory (``zoo.train.train``'s: its model's
    ``config.json`` beside ``checkpoints/``)."""
    path = Path(path)
    return (path / "checkpoints").is_dir() and (path / "config.json").is_file()


def load_run(run_dir: str | Path, *, compute_dtype: Any = None) -> tuple[Any, int, dict[str, Any]]:
    """The model of a training run directory at its latest good checkpoint: ``(model, step,
    settings)``, the settings those the run wrote to ``run.json`` (its ``TrainConfig`` under
    ``"train"``). Nothing in the directory is changed (a damaged checkpoint is passed over)."""
    import orbax.checkpoint as ocp

    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise CheckpointError(f"{run_dir}: not a training run directory (no config.json beside checkpoints/)")
    settings = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    family, config, raw = read_config(run_dir)
    if options := loading_options(family, settings):  # the model as trained (DeepSeek-V3's MTP module, say)
        family, config, raw = read_config(run_dir, **options)
    dtype = DTYPE_NAMES.get(raw.get("torch_dtype") or raw.get("dtype") or "float32", jnp.float32)
    compute_dtype = dtype if compute_dtype is None else compute_dtype
    abstract = jax.eval_shape(
        lambda: family(config, key=jax.random.key(0), param_dtype=dtype, compute_dtype=compute_dtype)
    )
    mesh = None
    if settings.get("mesh"):  # the arrays as the run laid them out: padded where its mesh did not divide them
        mesh = AbstractMesh(tuple(int(settings["mesh"].get(a, 1)) for a in parallel.AXES), parallel.AXES)
        abstract = parallel.pad(abstract, mesh)
    params = eqx.filter(abstract, is_param)
    opt_state = jax.eval_shape(optimizer(TrainConfig(steps=2, warmup=1), abstract).init, params)
    # Restored onto this process's first device, whatever devices the run saved from: orbax
    # otherwise lays each array out as saved, which another device count cannot.
    here = make_single_device_sharding(jax.local_devices()[0])
    params, opt_state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), (params, opt_state)
    )
    with _ReadOnlyNotes():  # orbax's three WARNING:absl notes that a read-only manager is read-only
        options = ocp.CheckpointManagerOptions(read_only=True)
        manager = ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options,
                                        item_handlers=ocp.StandardCheckpointHandler())  # fmt: skip
    try:
        step, tree = restore_latest(manager, run_dir, {"params": params, "opt_state": opt_state}, to_device=False,
                                    move_damaged=False)  # fmt: skip
    finally:
        manager.close()
    if tree is None:
        raise CheckpointError(f"{run_dir / 'checkpoints'}: no checkpoint yet")
    static = eqx.filter(abstract, is_param, inverse=True)
    model = eqx.combine(tree["params"], static)
    virtual = int((settings.get("train") or {}).get("virtual_stages", 1))
    if mesh is not None and virtual > 1:  # the run kept its stacks in the interleaved schedule's stage order
        model = reorder_stacks(model, mesh, virtual, inverse=True)
    return parallel.unpad(model), step, settings


def loading_options(family: type, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The config's loading options as a run recorded them (``run.json``'s ``model_config``): the
    keyword-only arguments of the family's ``from_hf``, which ``config.json`` does not hold
    (DeepSeek-V3's ``mtp``: a run of its presets trains the multi-token-prediction module)."""
    recorded = settings.get("model_config") or {}
    accepted = inspect.signature(family.config_cls.from_hf).parameters.values()
    return {p.name: recorded[p.name] for p in accepted
            if p.kind is p.KEYWORD_ONLY and p.name != "source" and p.name in recorded}  # fmt: skip


def load_model(path: str | Path, *, compute_dtype: Any = None) -> tuple[Any, dict[str, Any]]:
    """A model from a Hugging Face checkpoint directory or a training run directory (its latest
    good checkpoint, saying which): ``(model, settings)``, ``settings`` the run's (``{}`` for a
    checkpoint). What ``recipes/eval.py`` and ``recipes/generate.py`` load."""
    if is_run_dir(path):
        model, step, settings = load_run(path, compute_dtype=compute_dtype)
        print(f"{path}: training run, its checkpoint of step {step}", flush=True)
        return model, settings
    return from_pretrained(path, compute_dtype=compute_dtype), {}


# -- the interleaved schedule's stage order ------------------------------------------------------


def in_layer_order(params: Any, mesh: Any, virtual: int, memory: str) -> Any:
    """A run's parameters (kept in ``memory``) with their layer stacks in layer order: a run with
    ``virtual`` stages a pipeline stage holds them in stage order (:mod:`zoo.pipeline`)."""
    if mesh is None or virtual == 1:
        return params
    if memory != "device":  # reordering computes: on device
        params = tree_placement(params, "device")
    return reorder_stacks(params, mesh, virtual, inverse=True)


def check_stage_order(run_dir: Path, settings: Mapping[str, Any]) -> None:
    """A checkpoint in stage order holds its stacks in the saving run's order: resuming it with
    other virtual stages, or with any on another pipeline size, would put layers out of order."""

    def layout(s: Mapping[str, Any]) -> tuple[int, int]:
        virtual = int((s.get("train") or {}).get("virtual_stages", 1))
        stages = int((s.get("mesh") or {}).get("pipeline", 1))
        return (stages, virtual) if virtual > 1 and stages > 1 else (1, 1)

    try:
        before = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return  # check_resume says what is wrong with run.json
    if layout(before) != layout(settings):
        (p0, v0), (p1, v1) = layout(before), layout(settings)
        raise ConfigError(
            f"--resume: {run_dir}'s checkpoints hold the layer stacks in the stage order of {p0} pipeline stages x "
            f"{v0} virtual stages, this run would read them as {p1} x {v1}; resume with the saving run's mesh and "
            "virtual_stages (or continue from a --save-hf export)"
        )
