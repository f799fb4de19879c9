"""Pipeline, data, FSDP, tensor, expert and context parallelism: one device mesh, one ``jax.shard_map`` step.

The mesh always has the six axes of :data:`AXES` (size 1 when unused). Where each parameter
lives is *derived* from the model's own parameter description (:mod:`zoo.params`): every
dimension letter of a :class:`~zoo.params.Param` maps to at most one mesh axis by its family's
``config.axis_rules`` (:class:`zoo.causal_lm.AxisRule`), so a new model gets its layout from
its legend, not from a recipe.

The step (:func:`value_and_grad`) runs the unchanged model code under ``jax.shard_map`` with
explicit collectives. The model code calls the trace-time hooks of :mod:`zoo.hooks` (and
:func:`zoo.layers.moe.routed_experts` for expert parallelism), which are the identity outside
the step. Gradients need no hand-written collective: ``shard_map`` tracks which values vary
across which mesh axes, so the transpose of the FSDP all-gather is a reduce-scatter, and a
parameter replicated over the batch axes gets its gradient summed over them.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from zoo.errors import MeshError
from zoo.causal_lm import VOCAB
from zoo.hooks import (
    CONTEXT,
    GATHERED,
    PIPELINE,
    AnyMesh,
    PipelineSplit,
    VocabSplit,
    context_order,
    gather_fsdp,
    gather_layer,
    in_step,
    remat_policy,
    step_context,
    sum_to_varying_of,
    tensor_psum,
    varying_axes,
    varying_like,
    varying_over,
)
from zoo.layers.moe import routed_experts
from zoo.registry import family_of, is_model

# "context" splits the sequence (the batch arrays' second axis), in Llama 3's balanced order
# (zoo.hooks.context_order); attention gathers keys and values over it. "pipeline" splits the
# layer stacks into stages (zoo.pipeline); first, so it varies slowest over the devices: its
# point-to-point traffic is the least of any axis and the one to put across slow links.
AXES: tuple[str, ...] = (PIPELINE, "data", "fsdp", "context", "tensor", "expert")
# The expert group splits the batch too: its devices would otherwise repeat the same attention
# and dense work on the same tokens; the MoE layers then move tokens by all-to-all.
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")


# ---------------------------------------------------------------------------------------
# Mesh
# ---------------------------------------------------------------------------------------


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,fsdp=2,tensor=2"`` -> ``{"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}``.

    Every axis is present (1 when not named), so callers never special-case a missing one.
    """
    sizes = dict.fromkeys(AXES, 1)
    seen: set[str] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, eq, value = (s.strip() for s in part.partition("="))
        if not eq:
            raise MeshError(f"mesh spec {spec!r}: {part!r} is not axis=size (axes: {', '.join(AXES)})")
        _check_axis(name, f"mesh spec {spec!r}")
        if name in seen:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            raise MeshError(f"mesh spec {spec!r}: size of axis {name!r} must be an integer, got {value!r}") from None
        if size < 1:
            raise MeshError(f"mesh spec {spec!r}: size of axis {name!r} must be >= 1, got {size}")
        seen.add(name)
        sizes[name] = size
    return sizes


def _check_axis(name: str, where: str) -> None:
    if name not in AXES:
        close = difflib.get_close_matches(name, AXES, n=1, cutoff=0.4)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise MeshError(f"{where}: unknown mesh axis {name!r}{hint}; axes: {', '.join(AXES)}")


def make_mesh(spec: str | Mapping[str, int], *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with the six axes of :data:`AXES`, in that order, over ``devices`` (default all).

    The axis sizes must multiply to the device count: a silently idle device is a bug.
    Axis types are ``Auto`` so jitted code outside the step may still reshard freely.
    """
    if isinstance(spec, str):
        sizes = parse_mesh(spec)
    else:
        sizes = dict.fromkeys(AXES, 1)
        for name, size in spec.items():
            _check_axis(name, "make_mesh")
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
                raise MeshError(f"make_mesh: size of axis {name!r} must be a positive integer, got {size!r}")
            sizes[name] = int(size)
    devices = list(jax.devices() if devices is None else devices)
    total = math.prod(sizes.values())
    if total != len(devices):
        layout = " x ".join(f"{a}={sizes[a]}" for a in AXES)
        raise MeshError(
            f"mesh {layout} has {total} devices but {len(devices)} are available; the sizes must multiply to {len(devices)}"
        )
    shape = tuple(sizes[a] for a in AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    try:
        return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)
    except (ValueError, NotImplementedError):  # a device set make_mesh cannot tile: row-major order
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=auto)


def axis_names(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry: ``"fsdp"``, ``("pipeline", "fsdp")`` or ``None``."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _size(mesh: AnyMesh, axis: str | tuple[str, ...]) -> int:
    return math.prod(int(mesh.shape.get(a, 1)) for a in axis_names(axis))


# ---------------------------------------------------------------------------------------
# Layout derived from the parameter description
# ---------------------------------------------------------------------------------------


def _rules(obj: Any) -> Mapping[str, Any]:
    """The dimension-letter layout rules of a model's or config's family."""
    config = getattr(obj, "config", obj)
    return type(config).axis_rules


def _mesh_axis(param, letter: str, rules: Mapping[str, Any]) -> tuple[str, ...]:
    rule = rules.get(letter)
    if rule is None or (rule.stored_apart_only and letter not in param.stacked):
        return ()
    return axis_names(rule.mesh_axis)


def param_axes(param, mesh: AnyMesh | None = None, *, rules: Mapping[str, Any]
               ) -> tuple[str | tuple[str, ...] | None, ...]:  # fmt: skip
    """The mesh axis of each dimension of one :class:`~zoo.params.Param` (``None``: whole), or
    its axes (``("pipeline", "fsdp")``: a rule that splits its letter over several), by the
    family's ``rules`` (``config.axis_rules``). The first letter of the parameter's axes that
    maps to a mesh axis gets it; each mesh axis splits at most one of its dimensions.

    With a ``mesh``, axes of size 1 are left out: nothing is split over them, and the step's
    type checks then need no collective over them.
    """
    out: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    for letter in param.names:
        axes = tuple(a for a in _mesh_axis(param, letter, rules)
                     if a not in used and (mesh is None or _size(mesh, a) > 1))  # fmt: skip
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)


def _is_layer_stack(param) -> bool:
    """Scanned layer stacks lead with a stacked layer letter (``L``, ``Ld``, ``Lm``)."""
    names = param.names
    return bool(names) and names[0].startswith("L") and names[0] in param.stacked


def _model_specs(model) -> dict[str, Any]:
    return family_of(model).param_specs(model.config)


def _spec_tree(model, mesh: AnyMesh):
    from zoo.params import map_params

    specs, rules = _model_specs(model), _rules(model)

    def leaf(path: str, x):
        if path not in specs:
            raise KeyError(f"{type(model).__name__}: array {path!r} has no Param description")
        return PartitionSpec(*param_axes(specs[path], mesh, rules=rules))

    return map_params(leaf, model)


def partition_specs(model: PyTree, mesh: AnyMesh) -> PyTree[PartitionSpec]:
    """A ``PartitionSpec`` per array leaf, derived from the model's ``Param`` axes.

    ``model`` may also be any tree holding models (an optimizer state's ``mu``/``nu`` are
    models with the same leaves), or their ``jax.eval_shape``; arrays outside a model are
    replicated (``P()``).
    """

    def sub(x):
        if is_model(x):
            return _spec_tree(x, mesh)
        return PartitionSpec() if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) else x

    return jax.tree.map(sub, model, is_leaf=is_model)


def shard(model_or_tree: PyTree, mesh: Mesh, *, memory_kind: str | None = None) -> PyTree:
    """``device_put`` every array with its :func:`partition_specs` sharding, padded first where
    the mesh does not divide a padded letter (:func:`pad`).

    ``memory_kind`` (``"device"``, ``"pinned_host"``) is passed through, so parameters or
    optimizer state can be both sharded and kept in host memory between steps.
    """
    model_or_tree = pad(model_or_tree, mesh)
    specs = partition_specs(model_or_tree, mesh)

    def put(x, spec):
        if not isinstance(x, (jax.Array, np.ndarray)):
            return x
        return jax.device_put(x, NamedSharding(mesh, spec, memory_kind=memory_kind))

    return jax.tree.map(put, model_or_tree, specs)


def param_shardings(config: Any, mesh: Mesh, *, memory_kind: str | None = None) -> dict[str, NamedSharding]:
    """The ``NamedSharding`` of every parameter of ``config``'s family, by path, from its
    description: what :func:`shard` would give the whole model, for arrays made in place."""
    rules = _rules(config)
    specs = family_of(config).param_specs(config)
    return {
        path: NamedSharding(mesh, PartitionSpec(*param_axes(p, mesh, rules=rules)), memory_kind=memory_kind)
        for path, p in specs.items()
    }


def init_optimizer(tx: Any, params: PyTree, mesh: Mesh) -> PyTree:
    """``tx.init(params)`` jitted with its moments laid out like the parameters (their
    :func:`partition_specs`) and its step counts replicated: no device holds more than its
    share of the optimizer state, at any point."""
    abstract = jax.eval_shape(tx.init, params)
    specs = partition_specs(abstract, mesh)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.jit(tx.init, out_shardings=shardings)(params)


def replicate_unplaced(tree: PyTree, mesh: Mesh) -> PyTree:
    """Every array leaf not yet laid out on ``mesh`` replicated over it; the others unchanged.

    ``optimizer.init`` of sharded parameters gives moments sharded like them but step counts
    on one default device; committed to that device (a move to pinned host memory commits),
    they could not enter a step whose other arguments span the mesh.
    """

    def put(x):
        if isinstance(x, jax.Array) and not (isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh):
            return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
        return x

    return jax.tree.map(put, tree)


def _splits(config: Any, mesh: AnyMesh) -> dict[tuple[str, str | tuple[str, ...]], str]:
    """``(letter, mesh axis) -> first parameter split so``, for every split of ``config``'s layout."""
    rules = _rules(config)
    split: dict[tuple[str, str], str] = {}
    for path, p in family_of(config).param_specs(config).items():
        for letter, axis in zip(p.names, param_axes(p, mesh, rules=rules)):
            if axis is not None:
                split.setdefault((letter, axis), path)
    return split


def layout_sizes(config: Any, mesh: AnyMesh | None) -> dict[str, int]:
    """The size of every dimension letter as laid out on ``mesh``: ``config.sizes``, except that
    a letter whose rule pads (:class:`zoo.causal_lm.AxisRule` ``pad``) and that a mesh axis does
    not divide is rounded up to the axis's next multiple. Arrays made, loaded or placed on the
    mesh have these sizes; the entries beyond ``config.sizes`` are zeros that stay zeros."""
    config = getattr(config, "config", config)
    sizes = dict(config.sizes)
    if mesh is None:
        return sizes
    rules = _rules(config)
    for letter, axis in _splits(config, mesh):
        n = _size(mesh, axis)
        if rules[letter].pad and sizes[letter] % n:
            sizes[letter] = -(-sizes[letter] // n) * n
    return sizes


def is_padded(config: Any, mesh: AnyMesh | None) -> bool:
    """Whether :func:`layout_sizes` pads any dimension of ``config`` on ``mesh``."""
    config = getattr(config, "config", config)
    return layout_sizes(config, mesh) != dict(config.sizes)


def _resize(x: Any, shape: tuple[int, ...]) -> Any:
    """``x`` cut or zero-padded at the end of each axis to ``shape`` (a shape struct: its shape)."""
    if tuple(x.shape) == tuple(shape):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=getattr(x, "sharding", None))
    x = x[tuple(slice(0, min(a, b)) for a, b in zip(x.shape, shape))]
    return jnp.pad(x, [(0, b - a) for a, b in zip(x.shape, shape)]) if x.shape != shape else x


def _resized(model_or_tree: PyTree, sizes_of: Callable[[Any], Mapping[str, int]]) -> PyTree:
    from zoo.params import map_params

    def sub(m):
        if not is_model(m):
            return m
        specs, sizes = _model_specs(m), sizes_of(m)
        return map_params(lambda path, x: _resize(x, specs[path].shape(sizes)), m)

    return jax.tree.map(sub, model_or_tree, is_leaf=is_model)


def pad(model_or_tree: PyTree, mesh: AnyMesh | None) -> PyTree:
    """Every model in the tree with its arrays at :func:`layout_sizes` (zeros appended where a
    mesh axis does not divide a padded letter); a model already so is returned as it is."""
    def sizes(m):
        if mesh is not None:
            validate_mesh(mesh, m.config)
        return layout_sizes(m.config, mesh)

    return _resized(model_or_tree, sizes)


def unpad(model_or_tree: PyTree) -> PyTree:
    """Every model in the tree with its arrays at its config's own sizes (padding cut off): what
    one device, ``save_pretrained`` and ``transformers`` see."""
    return _resized(model_or_tree, lambda m: m.config.sizes)


def _would_work(size: int, axis: str, mesh: AnyMesh) -> str:
    devices = math.prod(int(n) for n in mesh.shape.values())
    divisors = [d for d in range(1, min(size, devices) + 1) if size % d == 0]
    return f"{axis}={' or '.join(map(str, divisors))} would work"


def validate_mesh(mesh: AnyMesh, config: Any) -> None:
    """Every dimension a mesh axis splits must divide evenly or be padded, and every axis must
    split something.

    A letter whose rule pads (the vocabulary, MLP hidden units) is laid out padded
    (:func:`layout_sizes`); any other split that does not divide raises :class:`MeshError`
    naming the config field, its value, the axis and the sizes that would work. ``config`` may
    also be a model. Checked up front because an uneven split fails deep inside XLA.
    """
    config = getattr(config, "config", config)
    rules = _rules(config)
    sizes = config.sizes
    name = type(config).__name__
    for axis in AXES:
        if axis not in mesh.shape:
            raise MeshError(
                f"mesh has no axis {axis!r}; build it with zoo.parallel.make_mesh (axes: {', '.join(AXES)})"
            )
    split = _splits(config, mesh)
    order = list(rules)
    for (letter, axis), path in sorted(split.items(), key=lambda kv: order.index(kv[0][0])):
        n = _size(mesh, axis)
        if sizes[letter] % n and not rules[letter].pad:
            field = rules[letter].field
            raise MeshError(
                f"{name}.{field} = {sizes[letter]} is not divisible by mesh axis {axis!r} of size {n} "
                f"(it splits dimension {letter} of {path}; {_would_work(sizes[letter], axis, mesh)}; "
                f"{letter} is not padded: that would change the model's function)"
            )
    used = {a for _, axis in split for a in axis_names(axis)}
    for axis in ("tensor", "expert", PIPELINE):
        if _size(mesh, axis) > 1 and axis not in used:
            what = {"expert": "experts", "tensor": "heads or hidden units", PIPELINE: "layer stack"}[axis]
            raise MeshError(
                f"mesh axis {axis!r} has size {_size(mesh, axis)} but {name} has no {what} to split over it; "
                "every device on it would repeat the same work (use data or fsdp instead)"
            )


# ---------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------


def _layer_plans(model, mesh: AnyMesh) -> tuple[dict[Any, list], list]:
    """Per layer stack (keyed by its tree structure), the dims each leaf of one layer is
    all-gathered on; and per model leaf, the dims a non-layer leaf is gathered on at the
    start of the step (none for layer-stack leaves: they are gathered layer by layer)."""
    from zoo.params import map_params

    specs, rules = _model_specs(model), _rules(model)
    stacks: dict[str, bool] = {}
    for path, p in specs.items():
        root = path.split(".")[0]
        stacks[root] = stacks.get(root, True) and _is_layer_stack(p)

    vocab = vocab_split_of(model, mesh) is not None

    def dims(path: str, drop: int) -> tuple[int, ...]:
        p = specs[path]
        axes = param_axes(p, mesh, rules=rules)
        # The embedding and head split on the vocabulary stay split: zoo.vocab_parallel streams them.
        return tuple(i - drop for i, a in enumerate(axes)
                     if "fsdp" in axis_names(a) and not (vocab and p.names[i] == VOCAB))  # fmt: skip

    plans = {}
    for root, is_stack in stacks.items():
        sub = getattr(model, root, None)
        if is_stack and sub is not None:
            plan = map_params(lambda path, x, root=root: dims(f"{root}.{path}", 1), sub)
            plans[jax.tree.structure(sub)] = jax.tree.leaves(plan, is_leaf=lambda d: isinstance(d, tuple))
    rest = map_params(lambda path, x: () if stacks[path.split(".")[0]] else dims(path, 0), model)
    return plans, jax.tree.leaves(rest, is_leaf=lambda d: isinstance(d, tuple))


def pipeline_split_of(model, mesh: AnyMesh, microbatches: int | None, virtual_stages: int = 1) -> PipelineSplit | None:
    """How the step pipelines ``model``'s layer stacks on ``mesh`` (``None`` without a
    ``pipeline`` axis): every stack whose layer letter the family maps to ``pipeline``, with its
    real layer count, and ``microbatches`` (default: one per stage, the fewest that fill it;
    with ``virtual_stages``, the stacks in :func:`zoo.pipeline.stage_order`)."""
    stages = _size(mesh, PIPELINE)
    if stages == 1:
        return None
    specs, rules = _model_specs(model), _rules(model)
    sizes = model.config.sizes
    layers = {}
    for root in dict.fromkeys(path.split(".")[0] for path, p in specs.items() if _is_layer_stack(p)):
        sub = getattr(model, root, None)
        stack = [p for path, p in specs.items() if path.split(".")[0] == root]
        if sub is not None and all(param_axes(p, mesh, rules=rules)[0] == PIPELINE for p in stack):
            layers[jax.tree.structure(sub)] = sizes[stack[0].names[0]]
    m = stages if microbatches is None else microbatches
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise MeshError(f"value_and_grad: microbatches must be a positive integer, got {microbatches!r}")
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise MeshError(f"value_and_grad: virtual_stages must be a positive integer, got {virtual_stages!r}")
    return PipelineSplit(stages, m, layers, v)


def vocab_split_of(model, mesh: AnyMesh) -> VocabSplit | None:
    """How the step splits ``model``'s vocabulary on ``mesh``, where the embedding and head are
    streamed instead of gathered whole (:mod:`zoo.vocab_parallel`): over ``fsdp`` and over the
    ``pipeline`` stages, those of the two that split the ``V`` of every parameter that has one;
    ``None`` where neither does (a vocabulary kept whole)."""
    specs, rules = _model_specs(model), _rules(model)
    found = {param_axes(p, mesh, rules=rules)[p.names.index(VOCAB)] for p in specs.values() if VOCAB in p.names}
    if len(found) != 1:
        return None
    axes = axis_names(found.pop())
    if not axes or not set(axes) <= {PIPELINE, "fsdp"} or axes[0] != PIPELINE and len(axes) > 1:
        return None
    return VocabSplit("fsdp" if "fsdp" in axes else None, _size(mesh, "fsdp") if "fsdp" in axes else 1,
                      model.config.vocab_size, PIPELINE if PIPELINE in axes else None, _size(mesh, PIPELINE))


def _check_batch(batch: Sequence[Any] | Mapping[str, Any], mesh: AnyMesh, axes: tuple[str, ...]) -> None:
    n = math.prod(_size(mesh, a) for a in axes)
    context = _size(mesh, CONTEXT)
    named = batch.items() if isinstance(batch, Mapping) else enumerate(batch)
    for key, arg in named:
        what = f"batch argument {key}" if isinstance(key, int) else f"keyword argument {key}="
        for leaf in jax.tree.leaves(arg):
            if not hasattr(leaf, "shape") or not leaf.shape:
                raise MeshError(f"{what}: the step splits arrays on their leading axis; got {leaf!r}")
            if leaf.shape[0] % n:
                raise MeshError(
                    f"{what}: leading size {leaf.shape[0]} is not divisible by "
                    f"{' x '.join(f'{a}={_size(mesh, a)}' for a in axes)} = {n}"
                )
            if context > 1 and (leaf.ndim < 2 or leaf.shape[1] % (2 * context)):
                raise MeshError(
                    f"{what}: context={context} splits the sequence (axis 1) into {2 * context} equal chunks; "
                    f"got shape {tuple(leaf.shape)}"
                )


def _trainable_mask(model) -> PyTree:
    from zoo.params import map_params

    specs = _model_specs(model)
    return map_params(lambda path, x: specs[path].trainable, model)


def value_and_grad(
    loss_fn: Callable[..., Any],
    mesh: AnyMesh,
    *,
    has_aux: bool = False,
    batch_axes: Sequence[str] = BATCH_AXES,
    microbatches: int | None = None,
    virtual_stages: int = 1,
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
    (the router bias) get zero gradients. Keyword arguments are passed to ``loss_fn``: arrays
    (``positions=``, ``segment_ids=``, ``loss_mask=``) split like the batch, anything else (``placement=``)
    as a static value. The returned function is jitted with ``eqx.filter_jit``.

    With a ``pipeline`` axis the layer stacks run as stages on it (:mod:`zoo.pipeline`): each
    device's rows are cut into ``microbatches`` micro-batches (default: the stage count) that
    flow through the stages; the rows are not split over ``pipeline``. ``virtual_stages=V``:
    the interleaved schedule, each stage's layers in ``V`` chunks that the micro-batches visit
    in ``V`` rounds of the stages (bubble ``(P-1)/(V·M+P-1)``); the model's pipelined stacks
    must then be in stage order (:func:`zoo.pipeline.to_stage_order`, which ``zoo.train`` applies).
    """
    return _sharded(loss_fn, mesh, has_aux, batch_axes, microbatches, virtual_stages, differentiate=True)


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
             microbatches: int | None, virtual_stages: int, *, differentiate: bool) -> Callable[..., Any]:  # fmt: skip
    batch_axes = tuple(batch_axes)
    for a in batch_axes:
        _check_axis(a, "value_and_grad batch_axes")
    if "tensor" in batch_axes:
        raise MeshError("value_and_grad: 'tensor' cannot split the batch: its devices share tokens and split heads")

    @eqx.filter_jit
    def step(model, *batch, **kwargs):
        validate_mesh(mesh, model.config)
        _check_padded(model, mesh)
        axes = tuple(a for a in batch_axes if _size(mesh, a) > 1)
        # Array keyword arguments (positions=, segment_ids=) are split like the batch.
        arrays = {k: v for k, v in kwargs.items() if any(isinstance(x, jax.Array) for x in jax.tree.leaves(v))}
        static = {k: v for k, v in kwargs.items() if k not in arrays}
        _check_batch(batch, mesh, axes)
        _check_batch(arrays, mesh, axes)
        specs = _spec_tree(model, mesh)
        plans, rest = _layer_plans(model, mesh)
        trainable = _trainable_mask(model)
        bspec = PartitionSpec(axes if axes else None)
        if (context := _size(mesh, CONTEXT)) > 1:
            # Each device gets two of the sequence's 2N chunks (i and 2N-1-i): equal causal work.
            bspec = PartitionSpec(axes if axes else None, CONTEXT)
            order = context_order(jax.tree.leaves((batch, arrays))[0].shape[1], context)
            batch, arrays = jax.tree.map(lambda x: jnp.take(x, order, axis=1), (batch, arrays))

        vary = tuple(dict.fromkeys(a for a in (*axes, CONTEXT) if _size(mesh, a) > 1))
        split = vocab_split_of(model, mesh)
        pipelined = pipeline_split_of(model, mesh, microbatches, virtual_stages)

        def body(params, local_arrays, *local_batch):
            with step_context(mesh, plans, split, pipelined) as ctx:

                def objective(p):
                    leaves, treedef = jax.tree.flatten(p)
                    # Each parameter is cast to varying over the batch axes once, here: its
                    # gradient is then all-reduced once, as the sum of its uses' (a tied
                    # embedding's lookup and head were two all-reduces of a [V, D] buffer).
                    leaves = [varying_over(gather_fsdp(x, d), vary) for x, d in zip(leaves, rest)]
                    p = jax.tree.unflatten(treedef, leaves)
                    out = loss_fn(p, *local_batch, **static, **local_arrays)
                    loss, aux = out if has_aux else (out, None)
                    stray = varying_axes(loss) - set(axes)
                    if stray:
                        raise MeshError(
                            f"the loss still varies over mesh axes {sorted(stray)}: the model code misses "
                            "a zoo.hooks hook (tensor_psum / zoo.layers.moe.routed_experts)"
                        )
                    over = tuple(a for a in axes if a in varying_axes(loss))
                    return (jax.lax.pmean(loss, over) if over else loss), aux

                if differentiate:
                    (loss, aux), grads = eqx.filter_value_and_grad(objective, has_aux=True)(params)
                else:
                    (loss, aux), grads = objective(params), None
                missing = [t for t, plan in plans.items() if any(plan) and t not in ctx.gathered]
                if missing and _size(mesh, "fsdp") > 1:
                    raise MeshError("the model's forward never called zoo.hooks.gather_layer on a layer stack")
            aux = jax.tree.map(lambda a: _reduce_aux(a, (*axes, CONTEXT)), aux)
            out = (loss, aux) if has_aux else loss
            if not differentiate:
                return out
            return out, jax.tree.map(lambda g, t: g if t else jnp.zeros_like(g), grads, trainable)

        in_specs = (specs, jax.tree.map(lambda _: bspec, arrays), *(jax.tree.map(lambda _: bspec, b) for b in batch))
        value_spec = (PartitionSpec(), PartitionSpec()) if has_aux else PartitionSpec()
        out_specs = (value_spec, specs) if differentiate else value_spec
        fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
        return fn(model, arrays, *batch)

    return step


def _check_padded(model, mesh: AnyMesh) -> None:
    """The model's arrays must have the mesh's layout sizes (:func:`pad`, which :func:`shard`
    applies): an unpadded embedding cannot be split, and the error names the array."""
    from zoo.params import flatten

    specs, sizes = _model_specs(model), layout_sizes(model.config, mesh)
    for path, x in flatten(model).items():
        want = specs[path].shape(sizes)
        if tuple(x.shape) != want:
            raise MeshError(
                f"{type(model).__name__}.{path} has shape {tuple(x.shape)}, but on this mesh it is laid out as {want} "
                "(padded where the mesh does not divide it): place the model with zoo.parallel.shard(model, mesh)"
            )


def _reduce_aux(a, axes: tuple[str, ...]):
    if not isinstance(a, jax.Array):
        return a
    over = tuple(x for x in axes if x in varying_axes(a))
    if not over:
        return a
    if jnp.issubdtype(a.dtype, jnp.integer):
        return jax.lax.psum(a, over)
    return jax.lax.pmean(a, over)


def param_bytes(tree: PyTree) -> int:
    """Parameter bytes held by one device: the first addressable shard of every array."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


# ---------------------------------------------------------------------------------------
# Multi-host
# ---------------------------------------------------------------------------------------


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """``jax.distributed.initialize`` from arguments or the environment; returns whether it ran.

    Falls back to ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``,
    then SLURM (``SLURM_NTASKS`` > 1: JAX's own cluster detection). One process: a no-op, so
    the same recipe runs on a laptop and on a cluster.
    """
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    slurm = int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env
    if coordinator is None and not slurm:
        if num_processes not in (None, 1):
            raise MeshError(f"initialize_distributed: num_processes={num_processes} needs a coordinator address")
        return False
    if num_processes == 1:
        return False
    if coordinator is not None and (num_processes is None or process_id is None):
        raise MeshError(
            f"initialize_distributed: coordinator {coordinator!r} given but "
            f"{'num_processes' if num_processes is None else 'process_id'} is missing "
            "(flag or JAX_NUM_PROCESSES / JAX_PROCESS_ID)"
        )
    if coordinator is None:
        jax.distributed.initialize()  # SLURM: JAX reads the job's own variables
    else:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    return True


__all__ = [
    "AXES", "BATCH_AXES", "GATHERED", "MeshError", "axis_names", "gather_layer", "in_step", "init_optimizer",
    "initialize_distributed",
    "is_padded", "layout_sizes", "make_mesh", "pad", "param_axes", "param_bytes", "param_shardings", "parse_mesh",
    "partition_specs", "remat_policy", "replicate_unplaced", "routed_experts", "shard", "sum_to_varying_of",
    "tensor_psum", "unpad", "validate_mesh", "value", "value_and_grad", "varying_like", "vocab_split_of",
]  # fmt: skip
