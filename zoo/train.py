"""The training step and loop: AdamW, schedule, clipping, accumulation, metrics, checkpoints.

Everything a recipe needs, so recipes stay thin. A step is a pure function
``(params, opt_state, batch) -> (params, opt_state, metrics)``; the loop around it is the only
place with I/O (metrics lines, orbax checkpoints, the loss-curve PNG).
"""

from __future__ import annotations

import fcntl
import functools
import inspect
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from zoo.errors import CheckpointError, ConfigError
from zoo.params import Param, map_params


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and loop settings (model shape lives in the model's config)."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0
    seed: int = 0
    # The model family's training options (``type(model).training_options``, e.g. DeepSeek-V3's
    # MTP weight); None: the family's defaults.
    model_options: Any = None
    # loop
    log_every: int = 25
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 200
    keep_checkpoints: int = 3

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every", "checkpoint_every",
                     "keep_checkpoints"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "clip"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.warmup < 0 or self.warmup > self.steps:
            raise ValueError(f"warmup must be in 0..steps ({self.steps}), got {self.warmup}")


def param_specs(model: eqx.Module) -> dict[str, Param]:
    """The model's parameter description (see :mod:`zoo.params`)."""
    from zoo.registry import family_of

    return family_of(model).param_specs(model.config)


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(cfg.warmup, 1), max(cfg.steps, cfg.warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio
    )


def optimizer(cfg: TrainConfig, model: eqx.Module) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay on weight matrices only (not norms or biases),
    global-norm clipping, and no update at all for buffers (the router's correction bias)."""
    specs = param_specs(model)
    params = eqx.filter(model, eqx.is_inexact_array)
    decay = map_params(lambda path, _: specs[path].trainable and specs[path].init == "normal", params)
    labels = map_params(lambda path, _: "train" if specs[path].trainable else "frozen", params)
    train = optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(learning_rate(cfg), cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay, mask=lambda _: decay),
    )
    # The trees are models, which are callable: optax would call them; hand it functions instead.
    return optax.multi_transform({"train": train, "frozen": optax.set_to_zero()}, lambda _: labels)


# What a batch may hold besides the token ids: packed rows' segments and positions, and which
# targets count (zoo.data.pack_documents). Each is [B, S] like the ids (or [A, B, S] per step).
BATCH_FIELDS = ("positions", "segment_ids", "loss_mask")


def as_batch(batch) -> dict[str, Any]:
    """A batch as a dict: ``{"input_ids": ...}`` plus any of :data:`BATCH_FIELDS`; a bare
    token array is its ``input_ids``. Unknown keys are an error naming them."""
    if not isinstance(batch, Mapping):
        return {"input_ids": batch}
    unknown = set(batch) - {"input_ids", *BATCH_FIELDS}
    if "input_ids" not in batch or unknown:
        raise ConfigError(
            f"a batch is input_ids plus any of {list(BATCH_FIELDS)}; got keys {sorted(batch)}"
            + (f" (unknown: {sorted(unknown)})" if unknown else "")
        )
    return dict(batch)


def _batch_sharding(mesh, micro: bool):
    from jax.sharding import NamedSharding, PartitionSpec

    from zoo import parallel

    axes = tuple(a for a in parallel.BATCH_AXES if mesh.shape[a] > 1)
    return NamedSharding(mesh, PartitionSpec(*([None] if micro else []), axes or None))


def local_rows(mesh, batch_size: int) -> np.ndarray | None:
    """The rows of a global batch of ``batch_size`` that this process's devices hold, sorted
    (``None`` with one process: all of them). Each process reads and packs only these."""
    if mesh is None or mesh.size == 1 or jax.process_count() == 1:
        return None
    index = _batch_sharding(mesh, micro=False).addressable_devices_indices_map((batch_size, 1))
    return np.unique(np.concatenate([np.arange(batch_size)[i[0]] for i in index.values()]))


def place_batch(batch, mesh=None, *, micro: bool = True, rows: np.ndarray | None = None, batch_size: int | None = None) -> Any:
    """A host batch (arrays ``[A, B, S]``, or ``[B, S]`` with ``micro=False``; or a dict of
    them) as device arrays. With a mesh,
    global arrays whose rows are split over the batch axes the step splits them over: each
    process puts on its own devices only their rows (``jax.make_array_from_callback``), so the
    same code runs on one host and on many, where every process computes the same batch from
    (seed, step). ``rows``: the host batch holds only these rows of a global batch of
    ``batch_size`` (:func:`local_rows`: each process's own)."""
    if mesh is None or mesh.size == 1:
        return jax.tree.map(jnp.asarray, batch)
    sharding = _batch_sharding(mesh, micro)
    axis = 1 if micro else 0

    def place(x):
        x = np.asarray(x)
        if rows is None:
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
        shape = (*x.shape[:axis], batch_size, *x.shape[axis + 1 :])

        def shard(index):
            wanted = np.arange(batch_size)[index[axis]]
            at = np.searchsorted(rows, wanted)
            if np.any(at >= len(rows)) or np.any(rows[np.minimum(at, len(rows) - 1)] != wanted):
                raise ValueError(f"place_batch: rows {wanted.tolist()} were not read by this process (it has {rows.tolist()})")
            local = list(index)
            local[axis] = at
            return x[tuple(local)]

        return jax.make_array_from_callback(shape, sharding, shard)

    return jax.tree.map(place, batch)


def loss_and_metrics(model: eqx.Module, input_ids: Int[Array, "B S"], *, cfg: TrainConfig, placement=None, **fields):
    """The model's training objective and what to log about it (``model.loss``); ``fields``:
    the batch's positions / segment_ids / loss_mask."""
    return model.loss(input_ids, options=cfg.model_options, placement=placement, **fields)


def _global_norm(tree) -> Float[Array, ""]:
    leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    return jnp.sqrt(sum(jnp.sum(x * x) for x in leaves))


def make_train_step(
    model: eqx.Module,
    cfg: TrainConfig,
    tx: optax.GradientTransformation,
    *,
    placement=None,
    mesh=None,
    param_memory: str = "device",
    opt_memory: str = "device",
) -> Callable:
    """``step(params, opt_state, batch, index) -> (params, opt_state, metrics)``, jitted.

    ``batch``: token ids ``[A, B, S]``, or a dict of them with any of :data:`BATCH_FIELDS`
    (packed rows, SFT masks), each ``[A, B, S]``. ``A = grad_accum`` micro-batches are scanned
    and their gradients averaged. With a
    ``mesh`` the gradients come from :func:`zoo.parallel.value_and_grad` (shard_map); without,
    from ``eqx.filter_value_and_grad``. ``param_memory`` / ``opt_memory``: where parameters and
    optimizer state live between steps (``pinned_host`` trees are brought to device inside the
    step and written back). After the update, ``model.after_step(metrics)`` makes the family's
    changes outside the gradient (DeepSeek-V3's router bias from the step's expert load).
    """
    from zoo.causal_lm import options_or_default
    from zoo.placement import memory_space, tree_placement

    options_or_default(model, cfg.model_options)  # a clear error now if they are another family's

    memory_space(param_memory, "parameters")  # a clear error now, not at the first step's trace
    memory_space(opt_memory, "optimizer state")
    static = eqx.filter(model, eqx.is_inexact_array, inverse=True)
    schedule = learning_rate(cfg)

    def loss_fn(m, ids, **fields):
        return loss_and_metrics(m, ids, cfg=cfg, placement=placement, **fields)

    if mesh is not None and mesh.size > 1:
        from zoo import parallel

        grad_fn = parallel.value_and_grad(loss_fn, mesh, has_aux=True)
    else:
        grad_fn = eqx.filter_value_and_grad(loss_fn, has_aux=True)

    def step(params, opt_state, batch, index):
        if param_memory != "device":
            params = tree_placement(params, "device")
        if opt_memory != "device":
            opt_state = tree_placement(opt_state, "device")

        batch = as_batch(batch)

        def grads_of(p, b):
            fields = {k: v for k, v in b.items() if k != "input_ids"}
            return grad_fn(eqx.combine(p, static), b["input_ids"], **fields)

        def micro(acc, b):
            (loss, metrics), grads = grads_of(params, b)
            grads = eqx.filter(grads, eqx.is_inexact_array)
            acc = jax.tree.map(jnp.add, acc, (loss, metrics, grads))
            return acc, None

        first = jax.tree.map(lambda x: x[0], batch)
        zeros = jax.tree.map(jnp.zeros_like, eqx.filter_eval_shape(grads_of, params, first))
        zeros = (zeros[0][0], zeros[0][1], eqx.filter(zeros[1], eqx.is_inexact_array))
        (loss, metrics, grads), _ = jax.lax.scan(micro, zeros, batch)
        n = batch["input_ids"].shape[0]
        loss = loss / n
        # Counts (integer metrics, such as an expert load) add up over micro-batches; the rest average.
        metrics = {k: (v if jnp.issubdtype(v.dtype, jnp.integer) else v / n) for k, v in metrics.items()}
        grads = jax.tree.map(lambda g: g / n, grads)
        # optax raises Python floats to int32 step counts, which strict promotion rejects.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
            lr = schedule(index)
        params = eqx.apply_updates(params, updates)
        params = eqx.filter(eqx.combine(params, static).after_step(metrics, cfg.model_options), eqx.is_inexact_array)
        out = {"loss": loss, "grad_norm": _global_norm(grads), "lr": jnp.asarray(lr, jnp.float32), **metrics}
        if param_memory != "device":
            params = tree_placement(params, param_memory)
        if opt_memory != "device":
            opt_state = tree_placement(opt_state, opt_memory)
        return params, opt_state, out

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval(model: eqx.Module, *, placement=None) -> Callable:
    """``evaluate(params, batch) -> mean next-token loss`` (the plain LM loss), jitted; ``batch``:
    token ids ``[B, S]`` or a dict of them with any of :data:`BATCH_FIELDS`."""
    from zoo.loss import lm_loss

    static = eqx.filter(model, eqx.is_inexact_array, inverse=True)

    @jax.jit
    def evaluate(params, batch):
        b = as_batch(batch)
        return lm_loss(eqx.combine(params, static), placement=placement, **b)

    return evaluate


def matmul_peak_flops(dtype=jnp.float32, n: int = 2048, repeats: int = 5) -> float:
    """The machine's own matmul peak: FLOP/s of a large XLA matmul (best of ``repeats``)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def device_memory_in_use() -> int | None:
    """Bytes in use on the first local device, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))


class MetricsLog:
    """Metrics as JSON lines and TensorBoard event files (beside each other, written by process
    0), and on the terminal a progress line (plain lines when not a TTY)."""

    def __init__(self, path: Path | None, total_steps: int):
        from zoo.metrics_log import TensorBoardWriter

        self.path, self.total = path, total_steps
        self.tty = sys.stdout.isatty()
        self.history: list[dict[str, Any]] = []
        self.tensorboard = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if jax.process_index() == 0:
                self.tensorboard = TensorBoardWriter(path.parent)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def write(self, record: Mapping[str, Any]) -> None:
        record = {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in record.items()}
        self.history.append(dict(record))
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.scalars(record["step"], {k: v for k, v in record.items() if k != "step"})
        parts = [f"step {record['step']}/{self.total}"]
        for key, fmt in (("loss", ".4f"), ("val_loss", ".4f"), ("tokens_per_s", ".0f"), ("mfu", ".1%"),
                         ("grad_norm", ".3f"), ("lr", ".2e")):  # fmt: skip
            if record.get(key) is not None:
                parts.append(f"{key} {format(record[key], fmt)}")
        if record.get("memory_bytes"):
            parts.append(f"mem {record['memory_bytes'] / 2**20:.0f}MiB")
        line = "  ".join(parts)
        if self.tty:
            bar = int(30 * record["step"] / self.total)
            print(f"\r[{'#' * bar}{'.' * (30 - bar)}] {line}", end="\n" if "val_loss" in record else "", flush=True)
        else:
            print(line, flush=True)


def plot_losses(history: list[Mapping[str, Any]], path: Path) -> Path | None:
    """Train and validation loss against step, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss-curve PNG", file=sys.stderr)
        return None
    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    valid = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class NonFiniteLoss(RuntimeError):
    """The loss, a metric, the parameters or the optimizer state became NaN or infinite.
    Nothing non-finite is written: the last checkpoint is good and left untouched."""


class RunDirError(ValueError):
    """A run directory in use by a running run, or holding an earlier run's files."""


def _named_leaves(tree) -> dict[str, Any]:
    """The array leaves of ``tree`` (arrays, shape structs, orbax metadata) by dotted path."""

    def name(key) -> str:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(map(name, path)): x for path, x in leaves if hasattr(x, "shape") and hasattr(x, "dtype")}


def _params_first(names) -> list[str]:
    """Leaf names with the parameters' first: an error names a parameter where one is at fault."""
    return sorted(names, key=lambda name: not name.startswith("params."))


def _describe(name: str) -> str:
    """A leaf of ``{"params": ..., "opt_state": ...}`` as a person would name it."""
    return f"parameter {name.removeprefix('params.')}" if name.startswith("params.") else f"optimizer state {name}"


def _bit_sum(x: Array) -> Array:
    """A wrapping uint32 sum of ``x``'s bits: changes with any damage to its stored bytes."""
    if x.dtype == jnp.bool_:
        return jnp.sum(x, dtype=jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)  # 8 bytes: two uint32 words
    return jnp.sum(jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32), dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnames="to_device")
def _audit(tree, to_device: bool = False) -> tuple[Array, Array]:
    """Per array leaf of ``tree`` (in ``_named_leaves`` order): whether it is finite, and its
    bit sum, in one pass: cheap enough to run before every save."""
    if to_device:  # pinned_host trees: computing needs them on the device
        from zoo.placement import tree_placement

        tree = tree_placement(tree, "device")
    leaves = list(_named_leaves(tree).values())
    finite = [jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True) for x in leaves]
    return jnp.stack(finite), jnp.stack([_bit_sum(x) for x in leaves])


def _first_non_finite(tree, finite) -> str | None:
    """The first leaf that ``_audit`` found non-finite, described (None: all finite)."""
    bad = [name for name, ok in zip(_named_leaves(tree), np.asarray(finite)) if not ok]
    return _describe(_params_first(bad)[0]) if bad else None


def _short(e: BaseException) -> str:
    """An exception in one short line (orbax's and TensorStore's messages run to pages); the
    innermost cause is the one that names the array and the file."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    line = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return line if len(line) <= 240 else line[:237] + "..."


def _flock(f, run_dir: Path) -> None:
    """Take ``f``'s exclusive lock, or refuse: another run holds it."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RunDirError(
            f"run dir {run_dir} is in use by another run (it holds {run_dir / '.lock'}): "
            "wait for it to end or choose another run dir"
        ) from None


# What a run writes into its run dir (and ``overwrite`` clears), and TensorBoard's event files.
_EVENTS = "events.out.tfevents.*"
_RUN_FILES = ("metrics.jsonl", "loss.png", "checkpoints", "damaged-checkpoints")


def _previous_run(run_dir: Path) -> list[str]:
    """The files of an earlier run that ``run_dir`` holds."""
    found = []
    for name in _RUN_FILES:
        path = run_dir / name
        if (path.is_dir() and any(path.iterdir())) or (path.is_file() and path.stat().st_size > 0):
            found.append(name)
    if any(p.is_file() for p in run_dir.glob(_EVENTS)):
        found.append(_EVENTS)
    return found


def check_run_dir(run_dir: str | Path, *, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse (``RunDirError``) a run dir that a running run holds, or that holds an earlier
    run, unless ``resume`` (continue it) or ``overwrite`` (replace it). Reads only: the
    recipe calls it before any compiling; ``train`` checks again and takes the lock."""
    run_dir = Path(run_dir)
    _refuse_a_file(run_dir)
    if (run_dir / ".lock").is_file():
        with open(run_dir / ".lock") as f:  # closing releases it
            _flock(f, run_dir)
    _refuse_previous_run(run_dir, resume, overwrite)


def _refuse_a_file(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run dir {run_dir} is not a directory")


def _refuse_previous_run(run_dir: Path, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise RunDirError("resume and overwrite exclude each other: continue the run or replace it")
    found = _previous_run(run_dir) if run_dir.is_dir() else []
    if found and not (resume or overwrite):
        raise RunDirError(
            f"run dir {run_dir} holds a previous run ({', '.join(found)}): "
            "continue it with --resume or replace it with --overwrite"
        )


class _RunDirLock:
    """The run dir, checked, cleared if ``overwrite``, and locked (``fcntl.flock`` on
    ``run_dir/.lock``) while the run lasts, so that a second run into it is refused.
    Only the first process of a multi-host run checks and locks (they share the dir)."""

    def __init__(self, run_dir: Path, resume: bool, overwrite: bool):
        self.run_dir, self.resume, self.overwrite, self.file = run_dir, resume, overwrite, None

    def __enter__(self):
        if jax.process_index() != 0:
            return self
        _refuse_a_file(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.run_dir / ".lock", "a")
        _flock(self.file, self.run_dir)
        try:
            _refuse_previous_run(self.run_dir, self.resume, self.overwrite)
            if self.overwrite and (found := _previous_run(self.run_dir)):
                for name in found:
                    for path in self.run_dir.glob(name):
                        shutil.rmtree(path) if path.is_dir() else path.unlink()
                print(f"overwrite: removed the previous run's {', '.join(found)} from {self.run_dir}", flush=True)
        except BaseException:
            self.file.close()
            raise
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()


def _truncate_metrics(path: Path, step: int) -> list[dict[str, Any]]:
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


def _misfit(saved: Mapping[str, Any], abstract) -> str | None:
    """How a checkpoint's arrays (orbax metadata) differ from the model's, or None."""
    want = _named_leaves(abstract)
    for name in _params_first(want):
        leaf = want[name]
        if name not in saved:
            return f"{_describe(name)} {tuple(leaf.shape)} is not in the checkpoint"
        if tuple(saved[name].shape) != tuple(leaf.shape):
            return (f"{_describe(name)} has shape {tuple(saved[name].shape)} in the checkpoint, "
                    f"{tuple(leaf.shape)} in the model")  # fmt: skip
    extra = _params_first(name for name in saved if name not in want)
    return f"{_describe(extra[0])} is in the checkpoint, not in the model" if extra else None


def _try_restore(manager, step: int, path: Path, abstract, to_device: bool) -> tuple[str | None, Any]:
    """``(None, tree)``, or ``(what is wrong, None)`` for a damaged checkpoint; raises
    ``CheckpointError`` for a checkpoint of another model (falling back would not help)."""
    import orbax.checkpoint as ocp

    try:
        meta = manager.item_metadata(step)
    except Exception as e:  # noqa: BLE001  (orbax and TensorStore raise plain Exceptions for damage)
        return f"its metadata does not read ({_short(e)})", None
    saved = _named_leaves(meta) if meta is not None else {}
    if not saved:
        return "its metadata is missing", None
    if (misfit := _misfit(saved, abstract)) is not None:
        raise CheckpointError(f"checkpoint step {step} ({path}) does not fit the model: {misfit} "
                              "(a checkpoint of another preset or model?)")  # fmt: skip
    try:
        tree = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # noqa: BLE001  (as above)
        return f"it does not restore ({_short(e)})", None
    finite, sums = _audit(tree, to_device=to_device)
    if (bad := _first_non_finite(tree, finite)) is not None:
        return f"its {bad} is not finite", None
    try:  # the bit sums saved with it (none in a checkpoint without its _CHECKPOINT_METADATA)
        expected = (manager.metadata(step).custom_metadata or {}).get("zoo", {}).get("checksums", {})
    except Exception:  # noqa: BLE001  (unreadable: unchecked, as for a checkpoint saved without them)
        expected = {}
    got = dict(zip(_named_leaves(tree), np.asarray(sums).tolist()))
    for name in _params_first(got):
        if name in expected and int(expected[name]) != got[name]:
            return f"its {_describe(name)} does not match the checksum saved with it", None
    return None, tree


def _restore_latest(manager, run_dir: Path, abstract, to_device: bool) -> tuple[int, Any]:
    """The newest checkpoint that restores and verifies: ``(step, tree)``; ``(0, None)`` if
    there is none. Damaged newer ones are moved to ``run_dir/damaged-checkpoints`` (kept,
    not deleted), saying so; with no good one left, ``CheckpointError`` names them all."""
    ckpt_dir = run_dir / "checkpoints"
    damaged: list[tuple[int, str]] = []
    for step in sorted(manager.all_steps(), reverse=True):
        problem, tree = _try_restore(manager, step, ckpt_dir / str(step), abstract, to_device)
        if problem is not None:
            damaged.append((step, problem))
            continue
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
            + ". Nothing to resume from: start over with --overwrite"
        )
    return 0, None


def batches(data, cfg: TrainConfig, start: int, rows: np.ndarray | None = None) -> Iterator[tuple[int, Any]]:
    """``(step, batch)`` from ``start``, ``batch`` the ``[A, B, S]`` stack of the data's
    micro-batches (token ids, or a dict of packed fields): a function of (seed, step) only.
    ``rows``: only these rows of each global batch (:func:`local_rows`)."""
    for step in range(start, cfg.steps):
        micro = [_batch_rows(data, rows, cfg.seed, step * cfg.grad_accum + i, cfg.batch_size, cfg.seq_len)
                 for i in range(cfg.grad_accum)]  # fmt: skip
        yield step, jax.tree.map(lambda *xs: np.stack(xs), *micro)


def _batch_rows(data, rows, *args, **kwargs):
    """``data.batch(...)`` restricted to ``rows``: read only them where the data takes ``rows=``
    (zoo's data does), else the whole batch cut down."""
    if rows is None:
        return data.batch(*args, **kwargs)
    if "rows" in inspect.signature(data.batch).parameters:
        return data.batch(*args, rows=rows, **kwargs)
    return jax.tree.map(lambda x: np.asarray(x)[rows], data.batch(*args, **kwargs))


def train(
    model: eqx.Module,
    data,
    cfg: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    placement=None,
    mesh=None,
    param_memory: str = "device",
    opt_memory: str = "device",
    peak_flops: float | None = None,
    stop_after: int | None = None,
    consume: bool = False,
) -> tuple[eqx.Module, list[dict[str, Any]]]:
    """Train ``model`` on ``data``; returns the trained model and the metric records.

    Checkpoints (orbax, asynchronous, atomic, last ``keep_checkpoints`` kept) go to
    ``run_dir/checkpoints`` every ``checkpoint_every`` steps and at the end. A run dir that
    holds an earlier run is refused unless ``resume`` (continue from its latest good
    checkpoint) or ``overwrite`` (remove it first); a run holds ``run_dir/.lock`` while it
    lasts. ``stop_after``: stop (without a final save) after that many steps of this call —
    for tests that interrupt a run. ``consume``: let the steps reuse the given model's
    buffers (no copy; the caller's ``model`` is unusable afterwards).
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError(f"seq_len {cfg.seq_len} is beyond the model's max_position_embeddings {limit}")
    if run_dir is None:
        return _train(model, data, cfg, None, False, placement, mesh, param_memory, opt_memory, peak_flops,
                      stop_after, consume)  # fmt: skip
    run_dir = Path(run_dir)
    with _RunDirLock(run_dir, resume, overwrite):
        return _train(model, data, cfg, run_dir, resume, placement, mesh, param_memory, opt_memory, peak_flops,
                      stop_after, consume)  # fmt: skip


def _train(model, data, cfg: TrainConfig, run_dir: Path | None, resume: bool, placement, mesh, param_memory: str,
           opt_memory: str, peak_flops: float | None, stop_after: int | None, consume: bool):  # fmt: skip
    """``train`` in a checked and locked run dir."""
    import orbax.checkpoint as ocp

    tx = optimizer(cfg, model)
    params = eqx.filter(model, eqx.is_inexact_array)
    if not consume:  # the steps donate their inputs
        params = jax.tree.map(jnp.copy, params)
    static = eqx.filter(model, eqx.is_inexact_array, inverse=True)
    opt_state = None
    if mesh is not None and mesh.size > 1:
        from zoo import parallel

        params = parallel.shard(params, mesh)
        opt_state = parallel.replicate_unplaced(tx.init(params), mesh)
    if opt_state is None:
        opt_state = tx.init(params)
    primary = jax.process_index() == 0
    start = 0
    manager = None
    previous: list[dict[str, Any]] = []  # the resumed run's metric records, for the loss curve
    if run_dir is not None:
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, enable_async_checkpointing=True)
        manager = ocp.CheckpointManager(
            (run_dir / "checkpoints").absolute(), options=options, item_handlers=ocp.StandardCheckpointHandler()
        )
    try:
        if manager is not None and resume:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
            start, restored = _restore_latest(manager, run_dir, abstract, to_device=False)
            if restored is not None:
                params, opt_state = restored["params"], restored["opt_state"]
                print(f"resumed from {run_dir / 'checkpoints'} at step {start}", flush=True)
            else:
                print(f"no checkpoint in {run_dir / 'checkpoints'}: starting from step 0", flush=True)
            if primary:
                previous = _truncate_metrics(run_dir / "metrics.jsonl", start)
            if start >= cfg.steps:
                print(f"run in {run_dir} already finished at step {start}; nothing to do", flush=True)
                return eqx.combine(params, static), []
        return _loop(model, data, cfg, run_dir, manager, start, previous, tx, params, opt_state, static, placement,
                     mesh, param_memory, opt_memory, peak_flops, stop_after)  # fmt: skip
    finally:
        if manager is not None:
            manager.close()  # waits for a save in flight: an interrupted run keeps it


def _loop(model, data, cfg, run_dir, manager, start, previous, tx, params, opt_state, static, placement, mesh,
          param_memory, opt_memory, peak_flops, stop_after):  # fmt: skip
    """The steps from ``start``, with metrics, checks and checkpoints."""
    import orbax.checkpoint as ocp

    from zoo.placement import tree_placement

    if param_memory != "device":
        params = tree_placement(params, param_memory, what="parameters")
    if opt_memory != "device":
        opt_state = tree_placement(opt_state, opt_memory, what="optimizer state")
    step_fn = make_train_step(
        model, cfg, tx, placement=placement, mesh=mesh, param_memory=param_memory, opt_memory=opt_memory
    )
    evaluate = make_eval(model, placement=placement)
    seq = cfg.seq_len
    flops_per_token = model.config.flops_per_token(seq)
    # Process 0 writes the metrics (every process computes the same ones).
    log = MetricsLog(run_dir / "metrics.jsonl" if run_dir and jax.process_index() == 0 else None, cfg.steps)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * seq
    last_time, last_step, done = time.perf_counter(), start, start
    on_host = param_memory != "device" or opt_memory != "device"

    def stop(what: str) -> NoReturn:
        if manager is not None:
            manager.wait_until_finished()
        last = manager.latest_step() if manager is not None else None
        if last is not None:
            kept = f"the last good checkpoint (step {last}, {run_dir / 'checkpoints' / str(last)}) is untouched"
        else:
            kept = "there is no checkpoint" if manager is not None else "nothing was saved (no run dir)"
        raise NonFiniteLoss(f"step {done}: {what}; stopping. Nothing non-finite was written: {kept}.")

    def save(step: int) -> None:
        if manager is None:
            return
        tree = {"params": params, "opt_state": opt_state}
        finite, sums = _audit(tree, to_device=on_host)  # the update can break what the loss did not show
        if (bad := _first_non_finite(tree, finite)) is not None:
            stop(f"the {bad} is not finite after the update")
        checksums = dict(zip(_named_leaves(tree), np.asarray(sums).tolist()))
        manager.save(step, args=ocp.args.StandardSave(tree), custom_metadata={"zoo": {"checksums": checksums}},
                     force=True)  # fmt: skip

    mine = local_rows(mesh, cfg.batch_size)  # this process's rows of every batch: all, on one process

    def validation_loss(params) -> float:
        p = tree_placement(params, "device") if param_memory != "device" else params
        batches_ = (
            place_batch(_batch_rows(data, mine, cfg.seed, i, cfg.batch_size, seq, split="valid"), mesh, micro=False,
                        rows=mine, batch_size=cfg.batch_size)  # fmt: skip
            for i in range(cfg.eval_batches)
        )
        return float(np.mean([float(evaluate(p, b)) for b in batches_]))

    if start == 0:  # where training starts from (about ln V for a fresh model)
        log.write({"step": 0, "val_loss": validation_loss(params)})
        last_time = time.perf_counter()
    for step, batch in batches(data, cfg, start, rows=mine):
        placed = place_batch(batch, mesh, rows=mine, batch_size=cfg.batch_size)
        params, opt_state, metrics = step_fn(params, opt_state, placed, jnp.int32(step))
        done = step + 1
        is_log = done % cfg.log_every == 0 or done == cfg.steps
        is_eval = done % cfg.eval_every == 0 or done == cfg.steps
        is_save = done % cfg.checkpoint_every == 0
        if is_log or is_eval or is_save:
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                stop(f"loss is {loss}")
            now = time.perf_counter()
            tps = tokens_per_step * (done - last_step) / (now - last_time)
            last_time, last_step = now, done
        if is_log or is_eval:
            record = {"step": done, "loss": loss, "tokens_per_s": tps}
            for k, v in metrics.items():
                if k != "loss":
                    record[k] = float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()
            if peak_flops:
                record["mfu"] = tps * flops_per_token / peak_flops
            record["memory_bytes"] = device_memory_in_use()
            if is_eval:
                record["val_loss"] = validation_loss(params)
                last_time = time.perf_counter()  # evaluation is not training throughput
            for k, v in record.items():  # metrics.jsonl holds finite numbers only (JSON has no NaN)
                if v is not None and not np.all(np.isfinite(np.asarray(v, dtype=float))):
                    stop(f"{k} is {v}")
            log.write(record)
        if done % cfg.checkpoint_every == 0 and done != cfg.steps:
            save(done)
        if stop_after is not None and done - start >= stop_after:
            if manager is not None:
                manager.wait_until_finished()
            log.close()
            return eqx.combine(params, static), log.history
    if manager is not None:
        if manager.latest_step() != done:
            save(done)
        manager.wait_until_finished()
    log.close()
    if run_dir is not None and log.history and jax.process_index() == 0:
        plot_losses(previous + log.history, run_dir / "loss.png")
    if param_memory != "device":
        params = tree_placement(params, "device")
    return eqx.combine(params, static), log.history
