"""The training step and loop: AdamW, schedule, clipping, accumulation, metrics, checkpoints.

Everything a recipe needs, so recipes stay thin. A step is a pure function
``(params, opt_state, batch) -> (params, opt_state, metrics)``; the loop around it is the only
place with I/O (metrics lines, orbax checkpoints, the loss-curve PNG).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

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
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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


def loss_and_metrics(model: eqx.Module, input_ids: Int[Array, "B S"], *, cfg: TrainConfig, placement=None):
    """The model's training objective and what to log about it (``model.loss``)."""
    return model.loss(input_ids, options=cfg.model_options, placement=placement)


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
    """``step(params, opt_state, batch[A, B, S], index) -> (params, opt_state, metrics)``, jitted.

    ``A = grad_accum`` micro-batches are scanned and their gradients averaged. With a
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

    def loss_fn(m, ids):
        return loss_and_metrics(m, ids, cfg=cfg, placement=placement)

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

        def micro(acc, ids):
            (loss, metrics), grads = grad_fn(eqx.combine(params, static), ids)
            grads = eqx.filter(grads, eqx.is_inexact_array)
            acc = jax.tree.map(jnp.add, acc, (loss, metrics, grads))
            return acc, None

        zeros = jax.tree.map(
            jnp.zeros_like, eqx.filter_eval_shape(lambda p: grad_fn(eqx.combine(p, static), batch[0]), params)
        )
        zeros = (zeros[0][0], zeros[0][1], eqx.filter(zeros[1], eqx.is_inexact_array))
        (loss, metrics, grads), _ = jax.lax.scan(micro, zeros, batch)
        n = batch.shape[0]
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
    """``evaluate(params, batch[B, S]) -> mean next-token loss`` (the plain LM loss), jitted."""
    from zoo.loss import lm_loss

    static = eqx.filter(model, eqx.is_inexact_array, inverse=True)
    return jax.jit(lambda params, ids: lm_loss(eqx.combine(params, static), ids, placement=placement))


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
    """Metrics as JSON lines, and on the terminal a progress line (plain lines when not a TTY)."""

    def __init__(self, path: Path | None, total_steps: int):
        self.path, self.total = path, total_steps
        self.tty = sys.stdout.isatty()
        self.history: list[dict[str, Any]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: Mapping[str, Any]) -> None:
        record = {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in record.items()}
        self.history.append(dict(record))
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
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
    """The loss became NaN or infinite; the last good checkpoint is left untouched."""


def batches(data, cfg: TrainConfig, start: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(step, tokens[A, B, S])`` from ``start``: a function of (seed, step) only."""
    for step in range(start, cfg.steps):
        micro = [data.batch(cfg.seed, step * cfg.grad_accum + i, cfg.batch_size, cfg.seq_len) for i in range(cfg.grad_accum)]
        yield step, np.stack(micro)


def train(
    model: eqx.Module,
    data,
    cfg: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
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
    ``run_dir/checkpoints`` every ``checkpoint_every`` steps and at the end; ``resume``
    continues from the latest. ``stop_after``: stop (without a final save) after that many
    steps of this call — for tests that interrupt a run. ``consume``: let the steps reuse the
    given model's buffers (no copy; the caller's ``model`` is unusable afterwards).
    """
    import orbax.checkpoint as ocp

    run_dir = Path(run_dir) if run_dir is not None else None
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
    start = 0
    manager = None
    if run_dir is not None:
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, enable_async_checkpointing=True)
        manager = ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options)
        if resume and manager.latest_step() is not None:
            start = manager.latest_step()
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
            restored = manager.restore(start, args=ocp.args.StandardRestore(abstract))
            params, opt_state = restored["params"], restored["opt_state"]
            print(f"resumed from {run_dir / 'checkpoints'} at step {start}", flush=True)
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
    log = MetricsLog(run_dir / "metrics.jsonl" if run_dir else None, cfg.steps)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * seq
    last_time, last_step, done = time.perf_counter(), start, start

    def save(step: int) -> None:
        if manager is not None:
            manager.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), force=True)

    def validation_loss(params) -> float:
        p = tree_placement(params, "device") if param_memory != "device" else params
        batches_ = (jnp.asarray(data.batch(cfg.seed, i, cfg.batch_size, seq, split="valid")) for i in range(cfg.eval_batches))
        return float(np.mean([float(evaluate(p, b)) for b in batches_]))

    if start == 0:  # where training starts from (about ln V for a fresh model)
        log.write({"step": 0, "val_loss": validation_loss(params)})
        last_time = time.perf_counter()
    for step, batch in batches(data, cfg, start):
        params, opt_state, metrics = step_fn(params, opt_state, jnp.asarray(batch), jnp.int32(step))
        done = step + 1
        is_log = done % cfg.log_every == 0 or done == cfg.steps
        is_eval = done % cfg.eval_every == 0 or done == cfg.steps
        is_save = done % cfg.checkpoint_every == 0
        if is_log or is_eval or is_save:
            loss = float(metrics["loss"])  # also checked before every save: a NaN is never written
            if not math.isfinite(loss):
                if manager is not None:
                    manager.wait_until_finished()
                raise NonFiniteLoss(
                    f"step {done}: loss is {loss}; stopping. The last good checkpoint "
                    f"(step {manager.latest_step() if manager else None}) is untouched."
                )
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
            log.write(record)
        if done % cfg.checkpoint_every == 0 and done != cfg.steps:
            save(done)
        if stop_after is not None and done - start >= stop_after:
            if manager is not None:
                manager.wait_until_finished()
            return eqx.combine(params, static), log.history
    if manager is not None:
        if manager.latest_step() != done:
            save(done)
        manager.wait_until_finished()
    if run_dir is not None and log.history:
        plot_losses(log.history, run_dir / "loss.png")
    if param_memory != "device":
        params = tree_placement(params, "device")
    return eqx.combine(params, static), log.history
