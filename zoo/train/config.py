"""Optimisation settings and what they build: ``TrainConfig``, the learning-rate schedule and
the optimizer (AdamW, clipping, weight decay and frozen buffers decided by the parameter
description), and the warning that a run's learning rate is too high (``RisingLoss``)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import optax

from zoo import lora
from zoo.core.params import Param, is_param, map_params, path_name
from zoo.core.registry import family_of


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and loop settings (model shape lives in the model's config)."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    # With a pipeline mesh axis: micro-batches each device's rows flow through the stages in
    # (zoo.pipeline; None: one per stage). Not gradient accumulation, which grad_accum is.
    microbatches: int | None = None
    # With a pipeline mesh axis: chunks of each stage's layers for the interleaved schedule
    # (zoo.pipeline; 1: GPipe). The run keeps the layer stacks in stage order.
    virtual_stages: int = 1
    # With a pipeline mesh axis: "gpipe", or "1f1b" (zoo.parallel.one_f_one_b: each micro-batch's
    # backward pass as soon as it leaves the last stage; a stage keeps at most 2P-1 micro-batches;
    # with virtual_stages, interleaved 1F1B).
    schedule: str = "gpipe"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    # Where the cosine decay ends (None: at ``steps``); steps after it train at the final lr. A
    # resume that changes ``steps`` keeps the run's own (zoo.train.resume.keep_schedule).
    decay_steps: int | None = None
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0
    seed: int = 0
    # The model family's training options (``type(model).training_options``, e.g. DeepSeek-V3's
    # MTP weight); None: the family's defaults.
    model_options: Any = None
    # Which matmuls run in FP8 and in which recipe: the family's precision map as a spec string
    # or map (zoo.layers.precision: "fp8_all", "mxfp8", "blockwise", DeepSeek-V3's "deepseek",
    # "fp8_all+mlp_down=none"); None: every matmul in the model's dtype.
    precision: Any = None
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
        if self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {self.schedule!r}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (a next-token loss predicts position t+1 from t), got {self.seq_len}")
        for name in ("lr", "clip"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.warmup < 0 or self.warmup > self.steps:
            raise ValueError(f"warmup must be in 0..steps ({self.steps}), got {self.warmup}")
        if self.decay_steps is not None and self.decay_steps < max(self.warmup, 1):
            raise ValueError(f"decay_steps must be >= warmup ({self.warmup}) and >= 1, got {self.decay_steps}")


def param_specs(model: eqx.Module) -> dict[str, Param]:
    """The model's parameter description (see :mod:`zoo.params`); an adapted model's
    (:class:`zoo.lora.LoraModel`): the base frozen, the adapters trainable."""
    if isinstance(model, lora.LoraModel):
        return lora.param_specs(model)
    return family_of(model).param_specs(model.config)


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    """Linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``decay_steps``
    (default ``steps``), that lr after it; ``warmup=0``: the first step at ``lr`` (a warm-up of
    one step would make it 0)."""
    end = cfg.steps if cfg.decay_steps is None else cfg.decay_steps
    if cfg.warmup == 0:
        return optax.cosine_decay_schedule(cfg.lr, max(end, 1), alpha=cfg.min_lr_ratio)
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(cfg.warmup, 1), max(end, cfg.warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio
    )


def trained(model: eqx.Module) -> eqx.Module:
    """``True`` on each parameter the optimizer trains, ``False`` on every other leaf (frozen
    parameters: a LoRA base, the router's correction bias; what is not a parameter): the filter
    that splits the model into what is differentiated and what is not."""
    specs = param_specs(model)
    return jax.tree_util.tree_map_with_path(lambda at, x: is_param(x) and specs[path_name(at)].trainable, model)


def optimizer(cfg: TrainConfig, model: eqx.Module) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay on weight matrices only (not norms or biases),
    global-norm clipping, and no update at all for buffers (the router's correction bias)."""
    specs = param_specs(model)
    params = eqx.filter(model, is_param)  # an abstract model's (jax.eval_shape) too
    decay = map_params(lambda path, _: specs[path].trainable and specs[path].init == "normal", params)
    labels = map_params(lambda path, _: "train" if specs[path].trainable else "frozen", params)
    train = optax.chain(
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(learning_rate(cfg), cfg.b1, cfg.b2, cfg.eps, weight_decay=cfg.weight_decay, mask=lambda _: decay),
    )
    # The trees are models, which are callable: optax would call them; hand it functions instead.
    return optax.multi_transform({"train": train, "frozen": optax.set_to_zero()}, lambda _: labels)


class RisingLoss:
    """Warns, once, when the training loss rises sharply early in a run: by a fifth over the
    first logged loss within the first quarter of the steps, the mark of a learning rate too
    high for the model (a pretrained checkpoint fine-tuned at a pretraining rate)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg, self.first, self.warned = cfg, None, False

    def check(self, step: int, loss: float) -> None:
        if self.first is None:
            self.first = (step, loss)
            return
        if self.warned or step > max(self.cfg.steps // 4, 2 * self.first[0]) or loss <= 1.2 * self.first[1]:
            return
        self.warned = True
        print(f"warning: the loss rose from {self.first[1]:.3f} at step {self.first[0]} to {loss:.3f} at step {step}: "
              f"the learning rate ({self.cfg.lr:g}) may be too high for this model (a pretrained checkpoint is "
              "usually fine-tuned at 1e-5 to 1e-4: --lr)", file=sys.stderr, flush=True)  # fmt: skip
