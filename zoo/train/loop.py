"""The training loop, ``train``: the only place with I/O around the pure step. It takes the
run dir's lock, restores the latest good checkpoint on resume, runs the steps with the
batches of (seed, step), logs, evaluates, saves, and stops on anything non-finite."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo import lora, parallel
from zoo.core.params import run_state
from zoo.errors import ConfigError
from zoo.placement import tree_placement
from zoo.train import checkpoints, restore
from zoo.train.batch import batch_rows, batches, check_batch_layout, local_rows, place_batch
from zoo.train.checkpoints import NonFiniteLoss
from zoo.train.config import RisingLoss, TrainConfig, optimizer
from zoo.train.metrics import MetricsLog, device_memory_in_use, plot_losses, run_settings
from zoo.train.preemption import Interrupted, Preempted, StopSignals, interrupted_message, preempted_message
from zoo.train.profile import CheckedStep, check_window
from zoo.train.resume import check_resume, keep_schedule
from zoo.train.run_dir import RunDirLock, write_run_files
from zoo.train.step import make_eval


def train(
    model: eqx.Module,
    data: Any,
    cfg: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    placement: Any = None,
    mesh: Any = None,
    param_memory: str = "device",
    opt_memory: str = "device",
    peak_flops: float | None = None,
    stop_after: int | None = None,
    consume: bool = False,
    wandb: str | None = None,
    sources: Mapping[str, Any] | None = None,
    allow_change: Iterable[str] = (),
    xla_options: Mapping[str, Any] | None = None,
    xla_defaults: bool = True,
    profile: tuple[int, int] | str | None = None,
) -> tuple[eqx.Module, list[dict[str, Any]]]:
    """Train ``model`` on ``data``; returns the trained model and the metric records.

    Checkpoints (orbax, asynchronous, atomic, last ``keep_checkpoints`` kept) go to
    ``run_dir/checkpoints`` every ``checkpoint_every`` steps and at the end. A run dir that
    holds an earlier run is refused unless ``resume`` (continue from its latest good
    checkpoint) or ``overwrite`` (remove it first); a run holds ``run_dir/.lock`` while it
    lasts. ``stop_after``: stop (without a final save) after that many steps of this call —
    for tests that interrupt a run. ``consume``: let the steps reuse the given model's
    buffers (no copy; the caller's ``model`` is unusable afterwards). ``wandb``: also log to
    this Weights & Biases project (needs ``wandb`` and a run dir). ``sources``: what the run is
    made from (the recipe's ``data`` and ``checkpoint``), kept in ``run_dir/run.json`` with the
    other settings; a resume whose settings differ from those is refused, listing the
    differences, except for the names in ``allow_change`` (and what never changes the numbers:
    ``zoo.train.resume.FREE_ON_RESUME``).

    The step compiles with the backend's XLA options (:data:`zoo.runtime.XLA_OPTIONS`) and
    ``xla_options`` on top (``xla_defaults=False``: only those); its placements are proven on the
    compiled program before step 1 (:mod:`zoo.train.verify`). ``profile``: ``"START:STOP"``, steps
    START..STOP-1 traced into ``run_dir/profile`` (:class:`zoo.train.profile.CheckedStep`).
    """
    lora.check_trainable(model, mesh=mesh)  # adapters where the model needs them (a quantized base), and what they allow
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError(f"seq_len {cfg.seq_len} is beyond the model's max_position_embeddings {limit}")
    check_batch_layout(cfg, mesh)
    if mesh is not None:  # the pipeline's chunks of layers, before the run dir is written
        parallel.validate_mesh(mesh, model.config, virtual_stages=cfg.virtual_stages)
    if hasattr(data, "check"):  # splits too short for a batch: refused before anything runs
        data.check(cfg.seq_len)
    if wandb is not None and run_dir is None:
        raise ConfigError("wandb logging needs a run dir (its files go to RUN_DIR/wandb)")
    profile = check_window(profile, cfg.steps, run_dir)
    run = _Run(model, data, cfg, None if run_dir is None else Path(run_dir), resume, placement, mesh, param_memory,
               opt_memory, peak_flops, stop_after, consume, wandb, dict(sources or {}), tuple(allow_change),
               dict(xla_options or {}), xla_defaults, profile)  # fmt: skip
    if run.run_dir is None:
        return _train(run)
    with RunDirLock(run.run_dir, resume, overwrite):
        return _train(run)


@dataclass(frozen=True)
class _Run:
    """``train``'s arguments, as the loop's parts read them."""

    model: eqx.Module
    data: Any
    cfg: TrainConfig
    run_dir: Path | None
    resume: bool
    placement: Any
    mesh: Any
    param_memory: str
    opt_memory: str
    peak_flops: float | None
    stop_after: int | None
    consume: bool
    wandb: str | None
    sources: dict[str, Any]
    allow_change: tuple[str, ...]
    xla_options: dict[str, Any]
    xla_defaults: bool
    profile: tuple[int, int] | None

    def in_layer_order(self, params: Any) -> Any:
        return restore.in_layer_order(params, self.mesh, self.cfg.virtual_stages, self.param_memory)

    def settings(self) -> dict[str, Any]:
        return run_settings(self.model, self.cfg, placement=self.placement, mesh=self.mesh,
                            param_memory=self.param_memory, opt_memory=self.opt_memory, sources=self.sources)  # fmt: skip


def _train(run: _Run) -> tuple[eqx.Module, list[dict[str, Any]]]:
    """``train`` in a checked and locked run dir: the state, restored on resume, then the loop."""
    import orbax.checkpoint as ocp

    model, cfg, run_dir = run.model, run.cfg, run.run_dir
    tx = optimizer(cfg, model)
    params, static = run_state(model)  # the floating arrays (and a quantized base's codes) and the rest
    if not run.consume:  # the steps donate their inputs
        params = jax.tree.map(jnp.copy, params)
    if run.mesh is not None and run.mesh.size > 1:
        # A no-op for a model made or loaded on the mesh (Family(..., mesh=), from_pretrained(mesh=)).
        params = parallel.shard(params, run.mesh)
        # The interleaved schedule's stage order (checkpoints too; returned in layer order).
        params = parallel.reorder_stacks(params, run.mesh, cfg.virtual_stages)
        opt_state = parallel.init_optimizer(tx, eqx.filter(params, eqx.is_inexact_array), run.mesh)
    else:
        opt_state = tx.init(eqx.filter(params, eqx.is_inexact_array))
    start = 0
    previous: list[dict[str, Any]] = []  # the resumed run's metric records, for the loss curve
    manager = checkpoints.open_manager(run_dir, cfg.keep_checkpoints) if run_dir is not None else None
    result: tuple[eqx.Module, list[dict[str, Any]]] | None = None
    try:
        if manager is not None and run.resume:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
            # A checkpoint of another model is refused as such first, by the restore.
            start, restored = restore.restore_latest(manager, run_dir, abstract, to_device=False)
            restore.check_stage_order(run_dir, run.settings())  # before check_resume: its refusal is the plainer
            # More (or fewer) steps: the decay keeps the run's length unless decay_steps may change too.
            kept, schedule = keep_schedule(run_dir, cfg, start, run.allow_change)
            if kept != cfg:
                run, cfg = dataclasses.replace(run, cfg=kept), kept
                tx = optimizer(cfg, model)  # the same state, on the run's schedule
            changed = check_resume(run_dir, run.settings(), run.allow_change)
            if changed:
                print("resuming with changed settings: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()),
                      flush=True)  # fmt: skip
            if schedule:
                print(schedule, flush=True)
            if restored is not None:
                params, opt_state = restored["params"], restored["opt_state"]
                print(f"resumed from {run_dir / 'checkpoints'} at step {start}", flush=True)
            else:
                print(f"no checkpoint in {run_dir / 'checkpoints'}: starting from step 0", flush=True)
            if jax.process_index() == 0:
                previous = restore.truncate_metrics(run_dir / "metrics.jsonl", start)
            if start >= cfg.steps:
                print(f"run in {run_dir} already finished at step {start}; nothing to do (to train it further: "
                      "--steps N --allow-change steps)", flush=True)  # fmt: skip
                result = eqx.combine(run.in_layer_order(params), static), []
        if result is None:
            result = _loop(run, manager, start, previous, tx, params, opt_state, static)
    except BaseException:
        if manager is not None:
            checkpoints.close(manager, run_dir, quietly=True)
        raise
    if manager is not None:
        checkpoints.close(manager, run_dir, quietly=False)
    return result


def _loop(run: _Run, manager: Any, start: int, previous: list[dict[str, Any]], tx: optax.GradientTransformation,
          params: Any, opt_state: Any, static: Any) -> tuple[eqx.Module, list[dict[str, Any]]]:  # fmt: skip
    """The steps from ``start``, with metrics, checks and checkpoints."""
    model, data, cfg, run_dir, mesh = run.model, run.data, run.cfg, run.run_dir, run.mesh
    param_memory, opt_memory = run.param_memory, run.opt_memory
    if param_memory != "device":
        params = tree_placement(params, param_memory, what="parameters")
    if opt_memory != "device":
        opt_state = tree_placement(opt_state, opt_memory, what="optimizer state")
    step_fn = CheckedStep(model, cfg, tx, placement=run.placement, mesh=mesh, param_memory=param_memory,
                          opt_memory=opt_memory, xla_options=run.xla_options, xla_defaults=run.xla_defaults,
                          profile=run.profile, run_dir=run_dir)  # fmt: skip
    evaluate = make_eval(model, placement=run.placement, mesh=mesh, microbatches=cfg.microbatches,
                         virtual_stages=cfg.virtual_stages, precision=cfg.precision)  # fmt: skip
    seq = cfg.seq_len
    flops_per_token = model.config.flops_per_token(seq)
    # Process 0 writes the metrics (every process computes the same ones).
    settings = run.settings()
    log = MetricsLog(run_dir if jax.process_index() == 0 else None, cfg.steps, settings=settings, wandb=run.wandb,
                     resume=run.resume, start=start)  # fmt: skip
    if run_dir is not None and jax.process_index() == 0:  # what load_run (eval, generate) rebuilds the model from
        write_run_files(run_dir, model, settings)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * seq
    last_time, last_step, done = time.perf_counter(), start, start
    on_host = param_memory != "device" or opt_memory != "device"

    def stop(what: str) -> NonFiniteLoss:
        return NonFiniteLoss(checkpoints.stop_message(manager, run_dir, done, what))

    saved = [start]  # the last step saved (or restored)

    def save(step: int) -> None:
        if manager is not None and saved[-1] != step:
            checkpoints.save(manager, run_dir, step, {"params": params, "opt_state": opt_state}, on_host=on_host)
            saved.append(step)

    mine = local_rows(mesh, cfg.batch_size)  # this process's rows of every batch: all, on one process
    rising = RisingLoss(cfg)

    def validation_loss(params) -> float:
        p = tree_placement(params, "device") if param_memory != "device" else params
        batches_ = (
            place_batch(batch_rows(data, mine, cfg.seed, i, cfg.batch_size, seq, split="valid"), mesh, micro=False,
                        rows=mine, batch_size=cfg.batch_size)  # fmt: skip
            for i in range(cfg.eval_batches)
        )
        return float(np.mean([float(evaluate(p, b)) for b in batches_]))

    stops = StopSignals()
    try:
        stops.install()
        if start == 0:  # where training starts from (about ln V for a fresh model)
            log.write({"step": 0, "val_loss": validation_loss(params)})
            last_time = time.perf_counter()
        for step, batch in batches(data, cfg, start, rows=mine):
            placed = place_batch(batch, mesh, rows=mine, batch_size=cfg.batch_size)
            params, opt_state, metrics = step_fn(params, opt_state, placed, step)
            done = step + 1
            is_log = done % cfg.log_every == 0 or done == cfg.steps
            is_eval = done % cfg.eval_every == 0 or done == cfg.steps
            is_save = done % cfg.checkpoint_every == 0
            if is_log or is_eval or is_save:
                loss = float(metrics["loss"])
                if not math.isfinite(loss):
                    raise stop(f"loss is {loss}")
                now = time.perf_counter()
                tps = tokens_per_step * (done - last_step) / (now - last_time)
                last_time, last_step = now, done
            if is_log or is_eval:
                record = {"step": done, "loss": loss, "tokens_per_s": tps}
                for k, v in metrics.items():
                    if k != "loss":
                        record[k] = float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()
                if run.peak_flops:
                    record["mfu"] = tps * flops_per_token / run.peak_flops
                record["memory_bytes"] = device_memory_in_use()
                if is_eval:
                    record["val_loss"] = validation_loss(params)
                    last_time = time.perf_counter()  # evaluation is not training throughput
                for k, v in record.items():  # metrics.jsonl holds finite numbers only (JSON has no NaN)
                    if v is not None and not np.all(np.isfinite(np.asarray(v, dtype=float))):
                        raise stop(f"{k} is {v}")
                log.write(record)
                rising.check(done, loss)
            if done % cfg.checkpoint_every == 0 and done != cfg.steps:
                save(done)
            if stops.reached(done) and done < cfg.steps:
                save(done)
                raise Preempted(preempted_message(manager, run_dir, stops.signal, done, cfg.steps), stops.signal or "SIGTERM")
            if run.stop_after is not None and done - start >= run.stop_after:
                if manager is not None:
                    checkpoints.wait(manager, run_dir)
                return eqx.combine(run.in_layer_order(params), static), log.history
        if manager is not None:
            save(done)
            checkpoints.wait(manager, run_dir)
    except KeyboardInterrupt as e:
        raise Interrupted(interrupted_message(manager, run_dir, done)) from e
    finally:
        step_fn.profiler.stop(done)
        stops.restore()
        log.close()
    if run_dir is not None and log.history and jax.process_index() == 0:
        plot_losses(previous + log.history, run_dir / "loss.png")
    if param_memory != "device":
        params = tree_placement(params, "device")
    return eqx.combine(run.in_layer_order(params), static), log.history
