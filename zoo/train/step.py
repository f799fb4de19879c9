"""The jitted step and evaluation: ``make_train_step`` (gradients, accumulation over
micro-batches, the update, the family's after-step change, parameters and optimizer state
brought from and back to their memory) and ``make_eval``; a step is a pure function
``(params, opt_state, batch, index) -> (params, opt_state, metrics)``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo import lora, parallel
from zoo.core.params import run_state
from zoo.core.protocol import options_or_default
from zoo.hooks.pipeline import stacks_in_stage_order
from zoo.layers import fp8, precision
from zoo.loss import lm_loss
from zoo.placement import memory_space, tree_placement
from zoo.train.batch import as_batch
from zoo.train.config import TrainConfig, learning_rate, trained


def loss_and_metrics(model: eqx.Module, input_ids: Int[Array, "B S"], *, cfg: TrainConfig, placement: Any = None,
                     **fields: Any) -> tuple[Float[Array, ""], dict[str, Array]]:  # fmt: skip
    """The model's training objective and what to log about it (``model.loss``); ``fields``:
    the batch's positions / segment_ids / loss_mask."""
    return model.loss(input_ids, options=cfg.model_options, placement=placement, **fields)


def matmul_recipes(model: eqx.Module, spec: Any) -> dict[str, str] | None:
    """``{matmul name: FP8 recipe}`` of the precision map ``spec`` (a spec string or map) for
    ``model``'s family (an adapted model's base); ``None``: no map, every matmul as written."""
    return None if spec is None else precision.resolve(spec, lora.base_model(model)).recipes()


def global_norm(tree: Any) -> Float[Array, ""]:
    """The global L2 norm of a tree's inexact arrays, in float32."""
    leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    return jnp.sqrt(sum(jnp.sum(x * x) for x in leaves))


def dropout_root(seed: int) -> PRNGKeyArray:
    """The key of a run's LoRA dropout masks (folded with the step and the micro-batch)."""
    return jax.random.fold_in(jax.random.key(seed), 0x10AD)


def make_train_step(
    model: eqx.Module,
    cfg: TrainConfig,
    tx: optax.GradientTransformation,
    *,
    placement: Any = None,
    mesh: Any = None,
    param_memory: str = "device",
    opt_memory: str = "device",
    xla_options: Mapping[str, Any] | None = None,
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
    ``xla_options``: XLA compile options of the step (:func:`zoo.runtime.step_xla_options`
    gives a backend's set; ``None``: XLA's defaults).
    """
    options_or_default(lora.base_model(model), cfg.model_options)  # a clear error now if they are another family's
    recipes = matmul_recipes(model, cfg.precision)

    memory_space(param_memory, "parameters")  # a clear error now, not at the first step's trace
    memory_space(opt_memory, "optimizer state")
    static = run_state(model)[1]
    schedule = learning_rate(cfg)
    stages = 1 if mesh is None else int(mesh.shape.get("pipeline", 1))
    dropping = isinstance(model, lora.LoraModel) and model.lora.dropout > 0

    def loss_fn(m, ids, **fields):
        return loss_and_metrics(m, ids, cfg=cfg, placement=placement, **fields)

    if mesh is not None and mesh.size > 1:
        # (frozen parameters, a LoRA base: no gradient at all, as below)
        grad_fn = parallel.value_and_grad(loss_fn, mesh, has_aux=True, microbatches=cfg.microbatches,
                                          virtual_stages=cfg.virtual_stages, schedule=cfg.schedule, frozen="none")  # fmt: skip
    else:
        # Differentiated: the trained parameters only. A frozen one's gradient would be zeros
        # carried through the accumulation and the update (a LoRA base's: the model's size).
        split = trained(model)

        def grad_fn(m, ids, **fields):
            train, frozen = eqx.partition(m, split)
            return eqx.filter_value_and_grad(lambda t: loss_fn(eqx.combine(t, frozen), ids, **fields), has_aux=True)(train)

    def step(params, opt_state, batch, index):
        if param_memory != "device":  # (a frozen base's layer stacks stay: the layer scan streams them)
            params = lora.place_unstreamed(params, lambda x: tree_placement(x, "device"))
        if opt_memory != "device":
            opt_state = tree_placement(opt_state, "device")

        batch = as_batch(batch)
        n = batch["input_ids"].shape[0]

        def grads_of(p, b, i):
            fields = {k: v for k, v in b.items() if k != "input_ids"}
            # LoRA dropout's masks: the run's seed, the step and the micro-batch (zoo.lora.dropout)
            # (made inside the step: a key made here at build time would be an array on one device)
            key = jax.random.fold_in(jax.random.fold_in(dropout_root(cfg.seed), index), i) if dropping else None
            with stacks_in_stage_order(stages, cfg.virtual_stages), fp8.using(recipes), lora.dropout_key(key):
                # (the run keeps its stacks in stage order: see train())
                return grad_fn(eqx.combine(p, static), b["input_ids"], **fields)

        def micro(acc, bi):
            (loss, metrics), grads = grads_of(params, *bi)
            grads = eqx.filter(grads, eqx.is_inexact_array)
            acc = jax.tree.map(jnp.add, acc, (loss, metrics, grads))
            return acc, None

        first = jax.tree.map(lambda x: x[0], batch)
        zeros = jax.tree.map(jnp.zeros_like, eqx.filter_eval_shape(grads_of, params, first, jnp.int32(0)))
        zeros = (zeros[0][0], zeros[0][1], eqx.filter(zeros[1], eqx.is_inexact_array))
        (loss, metrics, grads), _ = jax.lax.scan(micro, zeros, (batch, jnp.arange(n, dtype=jnp.int32)))
        loss = loss / n
        # Counts (integer metrics, such as an expert load) add up over micro-batches; the rest average.
        metrics = {k: (v if jnp.issubdtype(v.dtype, jnp.integer) else v / n) for k, v in metrics.items()}
        grads = jax.tree.map(lambda g: g / n, grads)
        # optax raises Python floats to int32 step counts, which strict promotion rejects.
        floating = eqx.filter(params, eqx.is_inexact_array)
        # The optimizer's tree has every parameter: a frozen one's gradient (never computed) is
        # zeros to it, which only its set_to_zero reads (XLA removes them), and its update is not applied.
        none = lambda x: x is None  # noqa: E731
        everything = jax.tree.map(lambda g, p: jnp.zeros_like(p) if g is None and p is not None else g, grads, floating,
                                  is_leaf=none)  # fmt: skip
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(everything, opt_state, floating)
            lr = schedule(index)
        updates = jax.tree.map(lambda g, u: None if g is None else u, grads, updates, is_leaf=none)
        params = eqx.apply_updates(params, updates)
        with stacks_in_stage_order(stages, cfg.virtual_stages):  # the run's stacks' layout
            params = run_state(eqx.combine(params, static).after_step(metrics, cfg.model_options))[0]
        out = {"loss": loss, "grad_norm": global_norm(grads), "lr": jnp.asarray(lr, jnp.float32), **metrics}
        if param_memory != "device":
            params = tree_placement(params, param_memory)
        if opt_memory != "device":
            opt_state = tree_placement(opt_state, opt_memory)
        return params, opt_state, out

    return jax.jit(step, donate_argnums=(0, 1), compiler_options=dict(xla_options) if xla_options else None)


def make_eval(model: eqx.Module, *, placement: Any = None, mesh: Any = None, microbatches: int | None = None,
              virtual_stages: int = 1, precision: Any = None) -> Callable:  # fmt: skip
    """``evaluate(params, batch) -> mean next-token loss`` (the plain LM loss), jitted; ``batch``:
    token ids ``[B, S]`` or a dict of them with any of :data:`BATCH_FIELDS`. With a ``mesh`` of
    more than one device, the loss runs laid out as the training step runs it
    (:func:`zoo.parallel.value`: ``microbatches`` through pipeline stages, ``virtual_stages``
    chunks of them, the stacks then in stage order), not as XLA would lay
    out a plain jit of it (which gathers a pipelined layer stack whole on every device).
    ``precision``: the training step's precision map (``TrainConfig.precision``)."""
    static = run_state(model)[1]
    recipes = matmul_recipes(model, precision)
    if mesh is not None and mesh.size > 1:
        loss = parallel.value(lm_loss, mesh, microbatches=microbatches, virtual_stages=virtual_stages)

        stages = int(mesh.shape.get("pipeline", 1))

        def sharded(params, batch):
            b = as_batch(batch)
            with stacks_in_stage_order(stages, virtual_stages), fp8.using(recipes):  # a run's stage order
                return loss(eqx.combine(params, static), b.pop("input_ids"), placement=placement, **b)

        return sharded

    @jax.jit
    def evaluate(params, batch):
        b = as_batch(batch)
        with fp8.using(recipes):
            return lm_loss(eqx.combine(params, static), placement=placement, **b)

    return evaluate
