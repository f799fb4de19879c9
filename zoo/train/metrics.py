"""What a run reports: the metrics log (``metrics.jsonl``, TensorBoard event files written by
tensorboardX, Weights & Biases where asked, a progress line on the terminal), the run's
settings as text once, the loss-curve PNG, and the figures behind throughput and MFU (the
machine's matmul peak, device memory in use)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zoo import lora
from zoo.errors import ConfigError
from zoo.hardware import HARDWARE, for_device
from zoo.lora import quantized
from zoo.placement import resolve


def _scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite scalar values of a record (lists such as an expert load, and None, left out)."""
    kept = {}
    for k, v in values.items():
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(x):
            kept[k] = x
    return kept


class TensorBoardWriter:
    """Scalars per step, and text, into a new event file in ``run_dir`` (created if missing),
    written by tensorboardX; every call is flushed, so ``tensorboard --logdir RUN_DIR`` follows
    a run live. Non-finite and non-scalar values are skipped. ``purge_step``: the file starts
    with a ``SessionLog.START`` at that step, on which TensorBoard drops the events of earlier
    files at that step and after (what a killed run logged past the checkpoint a resume starts from)."""

    def __init__(self, run_dir: str | Path, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(run_dir), purge_step=purge_step)

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        for tag, x in _scalars(values).items():
            self._writer.add_scalar(tag, x, int(step))
        self._writer.flush()

    def text(self, step: int, texts: Mapping[str, str]) -> None:
        for tag, text in texts.items():  # TensorBoard renders Markdown: keep the text verbatim
            self._writer.add_text(tag, f"```\n{text}\n```", int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardWriter:  # noqa: PYI034 (beartype checks no typing.Self here)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def require_wandb() -> Any:
    """The ``wandb`` module, or a ``ConfigError`` saying how to get it."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("--wandb: the wandb package is not installed (pip install wandb, or "
                          "pip install -e '.[wandb]')") from None  # fmt: skip
    return wandb


class WandbWriter:
    """Scalars per step to a Weights & Biases run in ``project``, its files under
    ``run_dir/wandb``; the run's settings are its config. ``WANDB_MODE=offline`` (wandb's own
    setting) logs without an account, to be synced later. A resumed zoo run continues the same
    W&B run (its id is kept in ``run_dir/wandb/zoo-run-id``)."""

    def __init__(self, project: str, run_dir: Path, config: Mapping[str, Any], *, resume: bool):
        wandb = require_wandb()
        id_file = run_dir / "wandb" / "zoo-run-id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        id_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=project, dir=str(run_dir), config=dict(config), name=run_dir.name,
                                  id=run_id, resume="allow" if run_id else None)  # fmt: skip
        except Exception as e:  # noqa: BLE001  (wandb raises its own errors for a missing login or network)
            raise ConfigError(f"--wandb {project}: wandb could not start a run ({type(e).__name__}: {e}); "
                              "WANDB_MODE=offline logs without an account or network") from None  # fmt: skip
        if run_id is None:
            id_file.write_text(self.run.id)

    def scalars(self, step: int, values: Mapping[str, Any]) -> None:
        if kept := _scalars(values):
            self.run.log(kept, step=int(step))

    def text(self, step: int, texts: Mapping[str, str]) -> None:
        pass  # the same settings are the run's config

    def close(self) -> None:
        self.run.finish()


def run_settings(model: Any, cfg: Any, *, placement: Any, mesh: Any, param_memory: str, opt_memory: str,
                 sources: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The run's settings as plain data: the model's class, config and dtypes, the
    ``TrainConfig``, what the run was made from (``sources``: the recipe's data and checkpoint),
    the mesh, where parameters and optimizer state live, and the placement map as a spec; with
    LoRA adapters (:class:`zoo.lora.LoraModel`), the base model's and the adapters' settings."""
    adapted, model = model, lora.base_model(model)
    if placement is None:
        where = "none (no jax.checkpoint: XLA keeps what the backward pass uses)"
    else:
        where = resolve(placement, model).spec()
    extra = {"lora": dataclasses.asdict(adapted.lora)} if isinstance(adapted, lora.LoraModel) else {}
    if isinstance(adapted, lora.LoraModel):  # QLoRA: the base's layer stacks in NF4 or int8 (a resume must match)
        extra["quantized_base"] = ",".join(sorted(quantized.formats(model))) or None
    return {
        **extra,
        "model": type(model).__name__,
        "model_config": dataclasses.asdict(model.config),
        "param_dtype": str(jnp.dtype(model.embed.dtype)),
        "compute_dtype": str(jnp.dtype(getattr(model, "compute_dtype", model.embed.dtype))),
        "train": dataclasses.asdict(cfg),
        "sources": dict(sources or {}),
        "mesh": dict(mesh.shape) if mesh is not None else None,
        "param_memory": param_memory,
        "opt_memory": opt_memory,
        "placement": where,
    }


def jsonable(x: Any) -> Any:
    """``x`` as plain JSON data (dtypes and other objects as their text)."""
    return json.loads(json.dumps(x, default=str))


class MetricsLog:
    """Metrics as JSON lines, TensorBoard event files (beside each other in ``run_dir``) and,
    with ``wandb`` (a project name), Weights & Biases; on the terminal a progress line (plain
    lines when not a TTY). ``run_dir`` None: the terminal only (a run without a run dir, or a
    process other than the first of a multi-host run). ``settings``: the run's, written once as
    text (and as the W&B config)."""

    def __init__(self, run_dir: Path | None, total_steps: int, *, settings: Mapping[str, Any] | None = None,
                 wandb: str | None = None, resume: bool = False, start: int = 0):  # fmt: skip
        self.path = run_dir / "metrics.jsonl" if run_dir is not None else None
        self.total = total_steps
        # The progress line's elapsed time and ETA: the pace since the first step logged (compiling is not a step).
        self.clock, self.start = time.perf_counter, start
        self.began, self.first = self.clock(), None
        self.tty = sys.stdout.isatty()
        self.history: list[dict[str, Any]] = []
        self.writers: list[Any] = []
        if run_dir is None:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        settings = jsonable(dict(settings or {}))
        # A resumed run logs the steps after ``start`` again (all from 0): TensorBoard drops the earlier run's.
        self.writers.append(TensorBoardWriter(run_dir, purge_step=(start + 1 if start else 0) if resume else None))
        if wandb is not None:
            self.writers.append(WandbWriter(wandb, run_dir, settings, resume=resume))
        if settings:
            texts = {"config": json.dumps(settings, indent=2)}
            if "placement" in settings:
                texts["placement"] = str(settings["placement"])
            for w in self.writers:
                w.text(start, texts)

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.writers = []

    def write(self, record: Mapping[str, Any]) -> None:
        record = {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in record.items()}
        self.history.append(dict(record))
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        for w in self.writers:
            w.scalars(record["step"], {k: v for k, v in record.items() if k != "step"})
        parts = [f"step {record['step']}/{self.total}"]
        # "loss" is the training objective; where the family adds terms to it, "lm_loss" is its
        # next-token part (val_loss is always the next-token loss).
        shown = [("loss", ".4f")] + ([("lm_loss", ".4f")] if record.get("lm_loss") != record.get("loss") else [])
        for key, fmt in (*shown, ("val_loss", ".4f"), ("tokens_per_s", ".0f"), ("mfu", ".1%"), ("grad_norm", ".3f"),
                         ("lr", ".2e")):  # fmt: skip
            if record.get(key) is not None:
                parts.append(f"{key} {format(record[key], fmt)}")
        if record.get("moe_dropped_pairs"):  # token dropping (moe_overflow "drop"): never silent
            parts.append(f"dropped {record['moe_dropped_pairs']:.0f} pairs")
        if record.get("memory_bytes"):
            parts.append(f"mem {record['memory_bytes'] / 2**20:.0f}MiB")
        parts.extend(self._timing(record["step"]))
        line = "  ".join(parts)
        if self.tty:
            bar = int(30 * record["step"] / self.total)
            print(f"\r[{'#' * bar}{'.' * (30 - bar)}] {line}", end="\n" if "val_loss" in record else "", flush=True)
        else:
            print(line, flush=True)

    def _timing(self, step: int) -> list[str]:
        """``elapsed T`` since the log began and, past the first step, ``eta T`` to ``total``."""
        now, parts = self.clock(), []
        if step > self.start:
            self.first = self.first or (step, now)
            at, then = self.first if step > self.first[0] else (self.start, self.began)
            parts.append(f"eta {duration((now - then) / (step - at) * max(self.total - step, 0))}")
        return [f"elapsed {duration(now - self.began)}", *parts]


def duration(seconds: float) -> str:
    """A time as the progress line says it: ``42s``, ``3m05s``, ``1h02m``."""
    s = max(0, round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


# The curves of the loss plot: the training objective, its next-token part, the validation loss.
CURVES = (("loss", "-"), ("lm_loss", "-"), ("val_loss", "o-"))


def curve_labels(history: list[Mapping[str, Any]]) -> tuple[str | None, str | None, str | None]:
    """What each curve of :data:`CURVES` is: the training objective is the next-token loss only
    where the family adds nothing to it (DeepSeek-V3 adds MTP and balance terms, Qwen3-MoE its
    balance loss); then its next-token part has a curve of its own (``None``: no curve)."""
    extra = any("lm_loss" in r and "loss" in r and r["lm_loss"] != r["loss"] for r in history)
    if extra:
        return "train objective (next-token loss + the family's terms)", "train next-token loss", "validation next-token loss"
    return "train next-token loss", None, "validation next-token loss"


def plot_losses(history: list[Mapping[str, Any]], path: Path) -> Path | None:
    """Train and validation loss against step, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss-curve PNG", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for (key, fmt), label in zip(CURVES, curve_labels(history)):
        points = [(r["step"], r[key]) for r in history if key in r]
        if points and label:
            ax.plot(*zip(*points), fmt, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def matmul_peak_flops(dtype: Any = jnp.float32, n: int = 2048, repeats: int = 20, min_seconds: float = 1.0) -> float:
    """The machine's own matmul peak: FLOP/s of a large XLA matmul, the best of at least
    ``repeats`` runs lasting ``min_seconds`` together, after three warm-up runs (five runs moved
    the figure 10-25% between two runs on a loaded 2-core machine: the first runs pay for
    clocks and caches, and one quiet run is the peak). For bf16 or fp16 on an accelerator in
    zoo.hardware's table, the table's dense peak: the figure MFU is quoted against."""
    device = jax.devices()[0]
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if half and device.platform != "cpu" and (name := for_device(device)) in HARDWARE:
        return HARDWARE[name].peak_flops
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    for _ in range(3):
        f(a).block_until_ready()
    best, runs, start = math.inf, 0, time.perf_counter()
    while runs < repeats or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        f(a).block_until_ready()
        best, runs = min(best, time.perf_counter() - t), runs + 1
    return 2 * n**3 / best


def device_memory_in_use() -> int | None:
    """Bytes in use on the first local device, where the backend reports it."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))
