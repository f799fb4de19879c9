"""The training step under ``jax.shard_map``: one program for pipeline, data, FSDP, context,
tensor and expert parallelism.

The step (:func:`value_and_grad`) runs the unchanged model code under ``jax.shard_map`` with
explicit collectives. The model code calls the trace-time hooks of :mod:`zoo.hooks` (and
:func:`zoo.layers.moe.routed_experts` for expert parallelism), which are the identity outside
the step. Gradients need no hand-written collective: ``shard_map`` tracks which values vary
across which mesh axes, so the transpose of the FSDP all-gather is a reduce-scatter, and a
parameter replicated over the batch axes gets its gradient summed over them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import PyTree

from zoo.core.layout import (
    StageOrdered,
    check_padded,
    family_model,
    gather_axes,
    is_layer_stack,
    model_specs,
    param_axes,
    rules_of,
    spec_tree,
    validate_mesh,
)
from zoo.core.mesh import BATCH_AXES, CONTEXT, PIPELINE, AnyMesh, axis_names, axis_size, check_axis
from zoo.core.params import is_array, is_deferred, map_params, path_name
from zoo.core.protocol import VOCAB
from zoo.errors import ConfigError, MeshError
from zoo.hooks.pipeline import stage_layout
from zoo.hooks.step import (
    ROUTED_EXPERTS,
    Gather,
    GatherLater,
    PipelineSplit,
    VocabSplit,
    context_order,
    gather_fsdp,
    stack_structure,
    step_context,
    varying_axes,
    varying_over,
)
from zoo.parallel import one_f_one_b


def _layer_plans(model, mesh: AnyMesh, batch_axes: tuple[str, ...]) -> tuple[dict[Any, list], PyTree, dict[Any, tuple]]:
    """Per layer stack (keyed by its tree structure), the dims each leaf of one layer is
    all-gathered on (:class:`Gather`: over ``fsdp`` and the expert group where it joins, as
    :func:`gather_axes` says; ``shared`` where those axes are not among ``batch_axes``); and per
    model leaf, the dims a non-layer leaf is gathered on at the start of the step (none for
    layer-stack leaves: they are gathered layer by layer). A layer's routed-experts weight,
    where no mesh axis splits its experts, is :class:`GatherLater`: the MoE layer gathers it
    a block of experts at a time. A sub-module the model declares a layer run on its own
    (``layer_blocks``) is gathered by the model like the stack's layer it is shaped as (its
    leaves: none at the start). The second is a tree shaped as the model, a tuple at each
    array. A :class:`zoo.core.protocol.Wrapper`'s own arrays (LoRA's adapters) are used as laid
    out: none is gathered. The third: per layer stack, each leaf's product
    (:attr:`zoo.core.params.Param.matmul`), for the products that gather their own weight
    (:func:`zoo.hooks.step.gathered_by_product`)."""

    wrapper, model = model, family_model(model)
    specs, rules, sizes = model_specs(model), rules_of(model), model.config.sizes
    stacks: dict[str, bool] = {}
    for path, p in specs.items():
        root = path.split(".")[0]
        stacks[root] = stacks.get(root, True) and is_layer_stack(p)

    vocab = vocab_split_of(model, mesh) is not None

    def dims(path: str, drop: int) -> tuple[Gather, ...]:
        p = specs[path]
        gathered = gather_axes(p, param_axes(p, mesh, rules=rules, sizes=sizes), rules=rules)
        # The embedding and head split on the vocabulary stay split: zoo.vocab_parallel streams them.
        return tuple(Gather(i - drop, axes, tuple(a for a in axes if a not in batch_axes))
                     for i, axes in enumerate(gathered) if axes and not (vocab and p.names[i] == VOCAB))  # fmt: skip

    def layer_dims(path: str, stacked: int = 1) -> tuple[Gather, ...] | GatherLater:
        d, names = dims(path, stacked), specs[path].names
        rule = rules.get(names[stacked]) if len(names) > stacked else None
        experts = rule is not None and rule.mesh_axis == "expert" and axis_size(mesh, "expert") == 1
        return GatherLater(d) if experts and d and all(g.dim > 0 for g in d) else d

    def layer_plan(sub: Any, prefix: str, stacked: int = 1) -> list:
        # (a weight held as what computes it, a quantized base's: one leaf, gathered as its weight)
        plan = jax.tree_util.tree_map_with_path(
            lambda at, x: layer_dims(f"{prefix}{path_name(at)}", stacked) if is_array(x) or is_deferred(x) else x,
            sub, is_leaf=is_deferred)  # fmt: skip
        return jax.tree.leaves(plan, is_leaf=lambda d: isinstance(d, tuple))

    def product(path: str, stacked: int) -> str | None:  # the name a gather is left to (gathered_by_product)
        names = specs[path].names
        rule = rules.get(names[stacked]) if len(names) > stacked else None
        experts = rule is not None and rule.mesh_axis == "expert" and len(names) == stacked + 3  # [E, in, out]
        return ROUTED_EXPERTS if experts else specs[path].matmul

    def layer_products(sub: Any, prefix: str, stacked: int = 1) -> tuple:
        names = jax.tree_util.tree_map_with_path(
            lambda at, x: (product(f"{prefix}{path_name(at)}", stacked),) if is_array(x) or is_deferred(x) else x,
            sub, is_leaf=is_deferred)  # fmt: skip
        return tuple(n[0] if isinstance(n, tuple) else None for n in jax.tree.leaves(names, is_leaf=lambda d: isinstance(d, tuple)))

    plans, products = {}, {}
    for root, is_stack in stacks.items():
        sub = getattr(model, root, None)
        if is_stack and sub is not None:
            plans[stack_structure(sub)] = layer_plan(sub, f"{root}.")
            products[stack_structure(sub)] = layer_products(sub, f"{root}.")
    blocks = tuple(getattr(type(model), "layer_blocks", ()))
    for block in blocks:
        sub = model
        for name in block.split("."):
            sub = getattr(sub, name, None)
        if sub is None:
            continue
        plan = layer_plan(sub, f"{block}.", 0)
        products.setdefault(stack_structure(sub), layer_products(sub, f"{block}.", 0))
        known = plans.setdefault(stack_structure(sub), plan)
        if known != plan:
            raise MeshError(
                f"{type(model).__name__}.layer_blocks: {block!r} has the structure of a layer stack of the model "
                "but not its layer's gathers (it must be shaped and split as that stack's layer)"
            )

    def start(path: str) -> tuple[Gather, ...]:  # gathered at the step's start: neither stacked nor a block
        if stacks[path.split(".")[0]] or any(path.startswith(f"{b}.") for b in blocks):
            return ()
        return dims(path, 0)

    rest = map_params(lambda path, x: start(path), model)
    if wrapper is not model:
        rest = eqx.tree_at(lambda w: w.base, map_params(lambda path, x: (), wrapper), rest)
    return plans, rest, products


SCHEDULES = ("gpipe", "1f1b")


def pipeline_split_of(model, mesh: AnyMesh, microbatches: int | None, virtual_stages: int = 1,
                      schedule: str = "gpipe") -> PipelineSplit | None:  # fmt: skip
    """How the step pipelines ``model``'s layer stacks on ``mesh`` (``None`` without a
    ``pipeline`` axis): every stack whose layer letter the family maps to ``pipeline``, with its
    real layer count, and ``microbatches`` (default: one per stage, the fewest that fill it;
    with ``virtual_stages``, the stacks in :func:`zoo.pipeline.stage_order`) on ``schedule``
    (:data:`SCHEDULES`)."""
    if schedule not in SCHEDULES:
        raise MeshError(f"value_and_grad: schedule must be one of {SCHEDULES}, got {schedule!r}")
    stages = axis_size(mesh, PIPELINE)
    if stages == 1:
        return None
    model = family_model(model)  # (a wrapper's arrays follow its base's stacks)
    specs, rules = model_specs(model), rules_of(model)
    sizes = model.config.sizes
    layers = {}
    for root in dict.fromkeys(path.split(".")[0] for path, p in specs.items() if is_layer_stack(p)):
        sub = getattr(model, root, None)
        stack = [p for path, p in specs.items() if path.split(".")[0] == root]
        if sub is not None and all(param_axes(p, mesh, rules=rules, sizes=sizes)[0] == PIPELINE for p in stack):
            layers[stack_structure(sub)] = sizes[stack[0].names[0]]
    m = stages if microbatches is None else microbatches
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise MeshError(f"value_and_grad: microbatches must be a positive integer, got {microbatches!r}")
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise MeshError(f"value_and_grad: virtual_stages must be a positive integer, got {virtual_stages!r}")
    return PipelineSplit(stages, m, layers, v, schedule)


def vocab_split_of(model, mesh: AnyMesh) -> VocabSplit | None:
    """How the step splits ``model``'s vocabulary on ``mesh``, where the embedding and head are
    streamed instead of gathered whole (:mod:`zoo.vocab_parallel`): over ``fsdp`` and over the
    ``pipeline`` stages, those of the two that split the ``V`` of every parameter that has one;
    ``None`` where neither does (a vocabulary kept whole)."""
    model = family_model(model)
    specs, rules = model_specs(model), rules_of(model)
    sizes = model.config.sizes
    found = {param_axes(p, mesh, rules=rules, sizes=sizes)[p.names.index(VOCAB)] for p in specs.values() if VOCAB in p.names}
    if len(found) != 1:
        return None
    axes = axis_names(found.pop())
    if not axes or not set(axes) <= {PIPELINE, "fsdp"} or axes[0] != PIPELINE and len(axes) > 1:
        return None
    return VocabSplit("fsdp" if "fsdp" in axes else None, axis_size(mesh, "fsdp") if "fsdp" in axes else 1,
                      model.config.vocab_size, PIPELINE if PIPELINE in axes else None, axis_size(mesh, PIPELINE))


def _check_batch(batch: Sequence[Any] | Mapping[str, Any], mesh: AnyMesh, axes: tuple[str, ...]) -> None:
    n = math.prod(axis_size(mesh, a) for a in axes)
    context = axis_size(mesh, CONTEXT)
    named = batch.items() if isinstance(batch, Mapping) else enumerate(batch)
    for key, arg in named:
        what = f"batch argument {key}" if isinstance(key, int) else f"keyword argument {key}="
        for leaf in jax.tree.leaves(arg):
            if not hasattr(leaf, "shape") or not leaf.shape:
                raise MeshError(f"{what}: the step splits arrays on their leading axis; got {leaf!r}")
            if leaf.shape[0] % n:
                raise MeshError(
                    f"{what}: leading size {leaf.shape[0]} is not divisible by "
                    f"{' x '.join(f'{a}={axis_size(mesh, a)}' for a in axes)} = {n}"
                )
            if context > 1 and (leaf.ndim < 2 or leaf.shape[1] % (2 * context)):
                raise MeshError(
                    f"{what}: context={context} splits the sequence (axis 1) into {2 * context} equal chunks; "
                    f"got shape {tuple(leaf.shape)}"
                )


def _trainable_mask(model) -> PyTree:
    """``True`` on each floating parameter the description trains, ``False`` on the other leaves."""
    specs = model_specs(model)
    return map_params(lambda path, x: specs[path].trainable and jnp.issubdtype(x.dtype, jnp.inexact), model)


def value_and_grad(
    loss_fn: Callable[..., Any],
    mesh: AnyMesh,
    *,
    has_aux: bool = False,
    batch_axes: Sequence[str] = BATCH_AXES,
    microbatches: int | None = None,
    virtual_stages: int = 1,
    schedule: str = "gpipe",
    frozen: str = "zeros",
) -> Callable[..., Any]:
    """``f(model, *batch, **static) -> (loss[, aux]), grads`` computed under ``jax.shard_map``.

    Each batch argument is split on its leading axis over ``batch_axes`` (default ``data``,
    ``fsdp`` and ``expert``: the MoE layers move tokens to their experts by all-to-all; without
    ``"expert"`` the expert group shares its tokens and repeats the non-expert work on them,
    and the MoE layers combine by ``psum``). Parameters arrive with
    their :func:`partition_specs` layout and the gradients leave with it. A loss already
    reduced over the devices (``zoo.lm_loss`` sums its terms and count with
    :func:`zoo.hooks.global_sum`: the exact mean over every counted prediction) is kept; what
    still varies over the batch axes is averaged (``pmean``). ``aux``
    leaves are reduced over the batch axes too: integer leaves (counts such as
    ``expert_load``) summed, floating leaves averaged. Parameters with ``trainable=False``
    (the router bias, a LoRA base) are not differentiated: their gradients are zeros, or with
    ``frozen="none"`` ``None`` (no buffer of a frozen base's size; an optimizer that never
    updates them takes them so). ``model`` may be a family's model or a
    :class:`zoo.core.protocol.Wrapper` around one (:class:`zoo.lora.LoraModel`), whose own
    arrays (the adapters) are laid out by its description. Keyword arguments are passed to ``loss_fn``: arrays
    (``positions=``, ``segment_ids=``, ``loss_mask=``) split like the batch, anything else (``placement=``)
    as a static value. The returned function is jitted with ``eqx.filter_jit``.

    With a ``pipeline`` axis the layer stacks run as stages on it (:mod:`zoo.pipeline`): each
    device's rows are cut into ``microbatches`` micro-batches (default: the stage count) that
    flow through the stages; the rows are not split over ``pipeline``. ``virtual_stages=V``:
    the interleaved schedule, each stage's layers in ``V`` chunks that the micro-batches visit
    in ``V`` rounds of the stages (bubble ``(P-1)/(V·M+P-1)``); the model must then come in
    stage order, as :func:`zoo.parallel.to_stage_order`'s ``StageOrdered`` (its gradients come
    back so), or as a plain model under ``zoo.pipeline.stacks_in_stage_order`` (``zoo.train``'s
    way); a model in layer order is refused, as it would compute another function.
    ``schedule="1f1b"``: each micro-batch's backward pass runs as soon as its forward pass leaves
    the last stage (:mod:`zoo.parallel.one_f_one_b`), so a stage keeps at most ``2P - 1``
    micro-batches' saved tensors, not ``M``; same numerics. The loss must divide by
    :func:`zoo.hooks.pipeline.batch_total` (``zoo.lm_loss`` does).
    """
    if schedule not in SCHEDULES:
        raise MeshError(f"value_and_grad: schedule must be one of {SCHEDULES}, got {schedule!r}")
    if frozen not in ("zeros", "none"):
        raise MeshError(f"value_and_grad: frozen must be 'zeros' or 'none', got {frozen!r}")
    return _sharded(loss_fn, mesh, has_aux, batch_axes, microbatches, virtual_stages, differentiate=True,
                    schedule=schedule, frozen=frozen)  # fmt: skip


def value(
    loss_fn: Callable[..., Any],
    mesh: AnyMesh,
    *,
    has_aux: bool = False,
    batch_axes: Sequence[str] = BATCH_AXES,
    microbatches: int | None = None,
    virtual_stages: int = 1,
) -> Callable[..., Any]:
    """``f(model, *batch, **static) -> loss[, aux]``: :func:`value_and_grad` without the
    gradient (an evaluation), the model laid out and run as in the training step: layers
    gathered over ``fsdp`` one at a time, the vocabulary streamed, the stages pipelined. (A
    plain ``jax.jit`` of the loss on the placed model leaves the layout to XLA, which gathers
    a layer stack split over ``pipeline`` whole on every device.)"""
    return _sharded(loss_fn, mesh, has_aux, batch_axes, microbatches, virtual_stages, differentiate=False)


def _sharded(loss_fn: Callable[..., Any], mesh: AnyMesh, has_aux: bool, batch_axes: Sequence[str],
             microbatches: int | None, virtual_stages: int, *, differentiate: bool,
             schedule: str = "gpipe", frozen: str = "zeros") -> Callable[..., Any]:  # fmt: skip
    batch_axes = tuple(batch_axes)
    for a in batch_axes:
        check_axis(a, "value_and_grad batch_axes")
    if "tensor" in batch_axes:
        raise MeshError("value_and_grad: 'tensor' cannot split the batch: its devices share tokens and split heads")

    @eqx.filter_jit
    def step(model, *batch, **kwargs):
        model, wrapped = _layer_stacks_as_scheduled(model, mesh, virtual_stages)
        validate_mesh(mesh, model.config, virtual_stages=virtual_stages)
        check_padded(model, mesh)
        axes = tuple(a for a in batch_axes if axis_size(mesh, a) > 1)
        # Array keyword arguments (positions=, segment_ids=) are split like the batch.
        arrays = {k: v for k, v in kwargs.items() if any(isinstance(x, jax.Array) for x in jax.tree.leaves(v))}
        static = {k: v for k, v in kwargs.items() if k not in arrays}
        _check_batch(batch, mesh, axes)
        _check_batch(arrays, mesh, axes)
        specs = spec_tree(model, mesh)
        plans, rest, products = _layer_plans(model, mesh, axes)
        trainable = _trainable_mask(model)
        bspec = PartitionSpec(axes if axes else None)
        if (context := axis_size(mesh, CONTEXT)) > 1:
            # Each device gets two of the sequence's 2N chunks (i and 2N-1-i): equal causal work.
            bspec = PartitionSpec(axes if axes else None, CONTEXT)
            order = context_order(jax.tree.leaves((batch, arrays))[0].shape[1], context)
            batch, arrays = jax.tree.map(lambda x: jnp.take(x, order, axis=1), (batch, arrays))

        vary = tuple(dict.fromkeys(a for a in (*axes, CONTEXT) if axis_size(mesh, a) > 1))
        split = vocab_split_of(model, mesh)
        pipelined = pipeline_split_of(model, mesh, microbatches, virtual_stages, schedule)

        def body(params, local_arrays, *local_batch):
            with step_context(mesh, plans, split, pipelined, rules_of(model), products) as ctx:

                def prepare(p):  # the parameters, or a part of them (None at the others)
                    # Each parameter is cast to varying over the batch axes once, here: its
                    # gradient is then all-reduced once, as the sum of its uses' (a tied
                    # embedding's lookup and head were two all-reduces of a [V, D] buffer).
                    return jax.tree.map(lambda d, x: None if x is None else varying_over(gather_fsdp(x, d), vary),
                                        rest, p, is_leaf=lambda d: isinstance(d, tuple))  # fmt: skip

                def loss_of(p, rows):
                    out = loss_fn(p, *rows[0], **static, **rows[1])
                    loss, aux = out if has_aux else (out, None)
                    stray = varying_axes(loss) - set(axes)
                    if stray:
                        raise MeshError(
                            f"the loss still varies over mesh axes {sorted(stray)}: the model code misses "
                            "a zoo.hooks hook (tensor_psum / zoo.layers.moe.routed_experts)"
                        )
                    over = tuple(a for a in axes if a in varying_axes(loss))
                    return (jax.lax.pmean(loss, over) if over else loss), aux

                # Differentiated: the trainable parameters only (a frozen one's gradient, a
                # LoRA base's, would be computed to be thrown away).
                diff, nondiff = eqx.partition(params, trainable)
                if differentiate and pipelined is not None and pipelined.schedule == "1f1b":
                    prepared_diff, prepare_vjp = jax.vjp(prepare, diff)
                    prepared_rest = prepare(nondiff)
                    (loss, aux), d_prepared = one_f_one_b.value_and_grad(
                        lambda d, rows: loss_of(eqx.combine(d, prepared_rest), rows),
                        prepared_diff, (local_batch, local_arrays), pipelined,
                    )  # fmt: skip
                    (grads,) = prepare_vjp(d_prepared)
                elif differentiate:
                    (loss, aux), grads = eqx.filter_value_and_grad(
                        lambda d: loss_of(eqx.combine(prepare(d), prepare(nondiff)), (local_batch, local_arrays)),
                        has_aux=True,
                    )(diff)
                else:
                    (loss, aux), grads = loss_of(prepare(params), (local_batch, local_arrays)), None
                missing = [t for t, plan in plans.items() if any(plan) and t not in ctx.gathered]
                if missing:
                    raise MeshError("the model's forward never called zoo.hooks.gather_layer on a layer stack")
                if set(ctx.later) - ctx.later_taken:
                    shapes = sorted({tuple(w.shape) for k, (w, _) in ctx.later.items() if k not in ctx.later_taken})
                    raise MeshError(
                        f"routed-experts weights of local shapes {shapes} were left to the MoE layer to gather "
                        "(zoo.hooks.step.GatherLater) but never reached zoo.layers.moe.routed_experts: pass the "
                        "layer's w_gate/w_up/w_down to it unchanged after gather_layer"
                    )
                if set(ctx.deferred) - ctx.deferred_taken:
                    shapes = sorted({tuple(s.shape) for k, (s, _, _) in ctx.deferred.items() if k not in ctx.deferred_taken})
                    raise MeshError(
                        f"layer weights of shapes {shapes} were left by gather_layer to the FP8 product their "
                        "parameter names (Param.matmul; zoo.hooks.step.gathered_by_product) but never reached it: "
                        "pass the weight unchanged after gather_layer to that zoo.layers.fp8.matmul"
                    )
            aux = jax.tree.map(lambda a: _reduce_aux(a, (*axes, CONTEXT)), aux)
            out = (loss, aux) if has_aux else loss
            if not differentiate:
                return out
            if frozen == "none":
                return out, grads
            return out, jax.tree.map(lambda g, p: jnp.zeros_like(p) if g is None and p is not None else g, grads, params,
                                     is_leaf=lambda x: x is None)  # fmt: skip

        in_specs = (specs, jax.tree.map(lambda _: bspec, arrays), *(jax.tree.map(lambda _: bspec, b) for b in batch))
        value_spec = (PartitionSpec(), PartitionSpec()) if has_aux else PartitionSpec()
        out_specs = (value_spec, specs) if differentiate else value_spec
        fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
        out = fn(model, arrays, *batch)
        if differentiate and wrapped:  # gradients in the model's own stage order, said as such
            out = (out[0], StageOrdered(out[1], axis_size(mesh, PIPELINE), virtual_stages))
        return out

    return step


def _layer_stacks_as_scheduled(model: Any, mesh: AnyMesh, virtual: int) -> tuple[Any, bool]:
    """The model to run, and whether it came as a :class:`StageOrdered`: the interleaved
    schedule (``virtual > 1`` on a pipeline) takes its stacks in stage order, and nothing else
    does; a model in the other order would compute another function, so it is refused."""
    stages = axis_size(mesh, PIPELINE)
    scheduled = (stages, virtual) if virtual > 1 and stages > 1 else (1, 1)
    if isinstance(model, StageOrdered):
        if (model.stages, model.virtual) != scheduled:
            raise ConfigError(
                f"the model's stacks are in the stage order of {model.stages} pipeline stages x {model.virtual} "
                f"virtual stages; this step runs {scheduled[0]} x {scheduled[1]} (virtual_stages={virtual}): "
                "zoo.parallel.to_stage_order(model, mesh, V, inverse=True) gives the model in layer order"
            )
        return model.model, True
    if scheduled != (1, 1) and stage_layout() != scheduled:
        raise ConfigError(
            f"virtual_stages={virtual}: the interleaved schedule takes the model with its stacks in stage order, "
            f"zoo.parallel.to_stage_order(model, mesh, {virtual}); a model in layer order would compute another function"
        )
    return model, False


def _reduce_aux(a, axes: tuple[str, ...]):
    if not isinstance(a, jax.Array):
        return a
    over = tuple(x for x in axes if x in varying_axes(a))
    if not over:
        return a
    if jnp.issubdtype(a.dtype, jnp.integer):
        return jax.lax.psum(a, over)
    return jax.lax.pmean(a, over)
