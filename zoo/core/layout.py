"""Where every parameter lives on a mesh, derived from the family's parameter description.

Each dimension letter of a :class:`~zoo.core.params.Param` maps to at most one mesh axis (or a
few, outermost first) by its family's ``config.axis_rules`` (:class:`zoo.core.protocol.AxisRule`),
so a new model gets its layout from its legend, not from a recipe. Loading
(:mod:`zoo.hf`), initialising in place (:func:`init_arrays`), placing (:mod:`zoo.parallel`) and
the planner all read the layout from here: the specs, the sizes a mesh pads letters to, and
the checks that a mesh can split a model at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PRNGKeyArray, PyTree

from zoo.core.mesh import AXES, PIPELINE, AnyMesh, axis_names, axis_size, virtual_fits, virtual_options
from zoo.core.params import Param, flatten, init_with_stacks, is_array, is_deferred, map_params, path_name
from zoo.core.protocol import AxisRule, Wrapper
from zoo.core.registry import family_of, is_model
from zoo.errors import ConfigError, MeshError


class StageOrdered(eqx.Module):
    """A model whose pipelined layer stacks are in the interleaved schedule's stage order for
    ``stages`` pipeline stages of ``virtual`` chunks (``zoo.parallel.to_stage_order``): what
    ``zoo.parallel.value_and_grad(..., virtual_stages=virtual)`` takes. It is not a model: a
    forward pass, a save or a loss of it would run its layers out of order, so nothing but the
    interleaved step computes with it; ``to_stage_order(..., inverse=True)`` gives the model back."""

    model: Any
    stages: int = eqx.field(static=True)
    virtual: int = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"a model in the stage order of {self.stages} pipeline stages x {self.virtual} virtual stages runs only in "
            f"the interleaved step; zoo.parallel.to_stage_order(model, mesh, {self.virtual}, inverse=True) gives it back"
        )


def rules_of(obj: Any) -> Mapping[str, Any]:
    """The dimension-letter layout rules of a model's or config's family."""
    config = getattr(obj, "config", obj)
    return type(config).axis_rules


# The letter of a quantized weight's codes (zoo.lora's QLoRA base): one dimension of their own,
# not the weight's letters, stored split over every axis that can split a weight's features,
# each where it still divides them (as optional axes join), and gathered whole where a layer is
# dequantized: the frozen base is held a block a device, as FSDP holds a trained one.
CODES = "codes"
CODES_RULE = AxisRule(mesh_axis=("fsdp", "expert", "tensor"), field="quantized codes",
                      optional=("fsdp", "expert", "tensor"))  # fmt: skip


def _rule(letter: str, rules: Mapping[str, Any]) -> Any:
    """The layout rule of ``letter``: the family's, or the codes' shared one."""
    return rules.get(letter, CODES_RULE if letter == CODES else None)


def _mesh_axis(param, letter: str, rules: Mapping[str, Any]) -> tuple[str, ...]:
    rule = _rule(letter, rules)
    if rule is None or (rule.stored_apart_only and letter not in param.stacked):
        return ()
    return axis_names(rule.mesh_axis)


def param_axes(param, mesh: AnyMesh | None = None, *, rules: Mapping[str, Any], sizes: Mapping[str, int] | None = None
               ) -> tuple[str | tuple[str, ...] | None, ...]:  # fmt: skip
    """The mesh axis of each dimension of one :class:`~zoo.params.Param` (``None``: whole), or
    its axes (``("fsdp", "expert")``: a rule that splits its letter over several, outermost
    first), by the family's ``rules`` (``config.axis_rules``). The first letter of the
    parameter's axes that maps to a mesh axis gets it; each mesh axis splits at most one of its
    dimensions.

    With a ``mesh``, axes of size 1 are left out: nothing is split over them, and the step's
    type checks then need no collective over them; and a rule's ``optional`` axes (the expert
    group joining ``fsdp``) join only where they and the letter's other axes divide its size
    in ``sizes`` (``config.sizes``, which a mesh with such an axis needs).
    """
    out: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    if param.own_sizes:
        sizes = {**(sizes or {}), **dict(param.own_sizes)}
    for letter in param.names:
        axes = tuple(a for a in _mesh_axis(param, letter, rules)
                     if a not in used and (mesh is None or axis_size(mesh, a) > 1))  # fmt: skip
        optional = set(_rule(letter, rules).optional) & set(axes) if axes else set()
        if mesh is not None and optional:
            if sizes is None:
                raise TypeError(f"param_axes: the rule of {letter!r} splits it over {sorted(optional)} only where "
                                "they divide it: pass sizes= (config.sizes)")  # fmt: skip
            kept = [a for a in axes if a not in optional]
            for a in axes:  # each optional axis joins where the split with it still divides
                if a in optional and sizes[letter] % (axis_size(mesh, (*kept, a))) == 0:
                    kept.append(a)
            axes = tuple(a for a in axes if a in kept)  # in the rule's order
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)


def gather_axes(param, axes: tuple[str | tuple[str, ...] | None, ...], *, rules: Mapping[str, Any]
                ) -> tuple[tuple[str, ...], ...]:  # fmt: skip
    """Per dimension of ``param`` laid out on ``axes`` (:func:`param_axes`), the mesh axes the
    step gathers it over before use: ``fsdp`` and the axes that join it optionally (the expert
    group, :data:`zoo.core.mesh.WEIGHT_SHARDS`), outermost first; tensor-, expert- and
    stage-split dimensions stay split."""
    out = []
    for letter, entry in zip(param.names, axes):
        rule = _rule(letter, rules)
        gathered = {"fsdp", *(rule.optional if rule is not None else ())}
        out.append(tuple(a for a in axis_names(entry) if a in gathered))
    return tuple(out)


def is_layer_stack(param) -> bool:
    """Scanned layer stacks lead with a stacked layer letter (``L``, ``Ld``, ``Lm``)."""
    names = param.names
    return bool(names) and names[0].startswith("L") and names[0] in param.stacked


def model_specs(model) -> dict[str, Any]:
    """The description of every array of a family's model, or of a :class:`Wrapper` around one."""
    if isinstance(model, Wrapper):
        return model.layout_specs()
    return family_of(model).param_specs(model.config)


def is_laid_out(x: Any) -> bool:
    """A tree the layout functions describe whole: a family's model, or a :class:`Wrapper`."""
    return is_model(x) or isinstance(x, Wrapper)


def family_model(model: Any) -> Any:
    """The family's model a step runs: ``model``, or the base under a :class:`Wrapper`."""
    return model.base if isinstance(model, Wrapper) else model


def spec_tree(model, mesh: AnyMesh):
    specs, rules, sizes = model_specs(model), rules_of(model), model.config.sizes

    def leaf(path: str, x):
        if path not in specs:
            raise KeyError(f"{type(model).__name__}: array {path!r} has no Param description")
        return PartitionSpec(*param_axes(specs[path], mesh, rules=rules, sizes=sizes))

    return map_params(leaf, model)


def partition_specs(model: PyTree, mesh: AnyMesh) -> PyTree[PartitionSpec]:
    """A ``PartitionSpec`` per array leaf, derived from the model's ``Param`` axes.

    ``model`` may also be any tree holding models (an optimizer state's ``mu``/``nu`` are
    models with the same leaves), or their ``jax.eval_shape``; arrays outside a model are
    replicated (``P()``).
    """

    def sub(x):
        if is_laid_out(x):
            return spec_tree(x, mesh)
        return PartitionSpec() if is_array(x) else x

    return jax.tree.map(sub, model, is_leaf=is_laid_out)


def param_shardings(config: Any, mesh: Mesh, *, memory_kind: str | None = None) -> dict[str, NamedSharding]:
    """The ``NamedSharding`` of every parameter of ``config``'s family, by path, from its
    description: what :func:`shard` would give the whole model, for arrays made in place."""
    rules = rules_of(config)
    specs = family_of(config).param_specs(config)
    return {
        path: NamedSharding(mesh, PartitionSpec(*param_axes(p, mesh, rules=rules, sizes=config.sizes)),
                            memory_kind=memory_kind)
        for path, p in specs.items()
    }


def _splits(config: Any, mesh: AnyMesh) -> dict[tuple[str, str | tuple[str, ...]], str]:
    """``(letter, mesh axis) -> first parameter split so``, for every split of ``config``'s layout."""
    rules = rules_of(config)
    split: dict[tuple[str, str], str] = {}
    for path, p in family_of(config).param_specs(config).items():
        for letter, axis in zip(p.names, param_axes(p, mesh, rules=rules, sizes=config.sizes)):
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
    rules = rules_of(config)
    for letter, axis in _splits(config, mesh):
        n = axis_size(mesh, axis)
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
    def sub(m):
        if not is_laid_out(m):
            return m
        specs, sizes = model_specs(m), sizes_of(m)

        def leaf(at, x):  # a Deferred weight (a quantized base's codes) kept whole: it is one device's
            if is_array(x):
                # (a letter the family does not size, a LoRA adapter's rank, keeps its size)
                names = specs[path_name(at)].names
                return _resize(x, tuple(sizes.get(a, n) for a, n in zip(names, x.shape)))
            return x

        return jax.tree_util.tree_map_with_path(leaf, m, is_leaf=is_deferred)

    return jax.tree.map(sub, model_or_tree, is_leaf=is_laid_out)


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


def _would_work(size: int, axis: str, mesh: AnyMesh, config: Any = None, split: Any = ()) -> str:
    """The sizes of ``axis`` that divide ``size`` and (a single axis, with ``config`` and its
    ``split``) every other unpadded dimension that axis splits: only sizes the model accepts."""
    devices = math.prod(int(n) for n in mesh.shape.values())
    divisors = [d for d in range(1, min(size, devices) + 1) if size % d == 0]
    names = axis_names(axis)
    if config is not None and len(names) == 1:
        rules, sizes = rules_of(config), config.sizes

        def accepted(d: int) -> bool:
            return all(sizes[letter] % math.prod(d if a == names[0] else axis_size(mesh, a) for a in axis_names(ax)) == 0
                       for letter, ax in split
                       if names[0] in axis_names(ax) and not rules[letter].pad
                       and names[0] not in rules[letter].optional)  # an optional join just drops out: no constraint  # fmt: skip

        divisors = [d for d in divisors if accepted(d)]
    return f"{axis}={' or '.join(map(str, divisors))} would work"


def validate_mesh(mesh: AnyMesh, config: Any, *, virtual_stages: int = 1) -> None:
    """Every dimension a mesh axis splits must divide evenly or be padded, every axis must
    split something, and the family must accept the layout (its ``check_layout``; with
    ``virtual_stages``, the interleaved pipeline schedule's chunks per stage).

    A letter whose rule pads (the vocabulary, MLP hidden units) is laid out padded
    (:func:`layout_sizes`); any other split that does not divide raises :class:`MeshError`
    naming the config field, its value, the axis and the sizes that would work. ``config`` may
    also be a model. Checked up front because an uneven split fails deep inside XLA.
    """
    config = getattr(config, "config", config)
    rules = rules_of(config)
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
        n = axis_size(mesh, axis)
        if sizes[letter] % n and not rules[letter].pad:
            field = rules[letter].field
            raise MeshError(
                f"{name}.{field} = {sizes[letter]} is not divisible by mesh axis {axis!r} of size {n} "
                f"(it splits dimension {letter} of {path}; {_would_work(sizes[letter], axis, mesh, config, split)}; "
                f"{letter} is not padded: that would change the model's function)"
            )
    # An axis that only joins another's split (the expert group on the FSDP-split weights) gives
    # its devices no work of their own: a model without experts has none for "expert".
    used = {a for letter, axis in split for a in axis_names(axis) if a not in rules[letter].optional}
    for axis in ("tensor", "expert", PIPELINE):
        if axis_size(mesh, axis) > 1 and axis not in used:
            what = {"expert": "experts", "tensor": "heads or hidden units", PIPELINE: "layer stack"}[axis]
            raise MeshError(
                f"mesh axis {axis!r} has size {axis_size(mesh, axis)} but {name} has no {what} to split over it; "
                "every device on it would repeat the same work (use data or fsdp instead)"
            )
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) or virtual_stages < 1:
        raise MeshError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    stages = axis_size(mesh, PIPELINE)
    # The layer letters (L, Ld, Lm) of the scanned stacks: the vocabulary split over the stages is no layer stack.
    layers = {p.names[0] for p in family_of(config).param_specs(config).values() if is_layer_stack(p)}
    for letter, axis in split:
        per_stage = -(-sizes[letter] // stages)  # padded to whole stages
        if (virtual_stages > 1 and letter in layers and axis_names(axis) == (PIPELINE,)
                and not virtual_fits(per_stage, virtual_stages)):  # fmt: skip
            raise MeshError(
                f"virtual_stages={virtual_stages} cannot split the {per_stage} layers per stage of "
                f"{name}.{rules[letter].field} = {sizes[letter]} on pipeline={stages} (the interleaved schedule "
                f"runs each stage's layers in virtual_stages chunks of ceil({per_stage}/virtual_stages), the "
                f"last holding the rest, none empty; possible here: {virtual_options(per_stage)})"
            )
    family_of(config).check_layout(config, mesh, virtual_stages=virtual_stages)


def check_padded(model, mesh: AnyMesh) -> None:
    """The model's arrays must have the mesh's layout sizes (:func:`pad`, which :func:`shard`
    applies): an unpadded embedding cannot be split, and the error names the array. (A
    :class:`Wrapper`'s base: its own arrays are not padded; nor is a weight held as what
    computes it, a quantized base's, which is checked where it is made.)"""
    model = family_model(model)
    specs, sizes = model_specs(model), layout_sizes(model.config, mesh)
    for path, x in flatten(model).items():
        if path not in specs and path.rsplit(".", 1)[0] in specs:  # a Deferred weight's arrays: "<weight>.<field>"
            continue
        want = specs[path].shape(sizes)
        if tuple(x.shape) != want:
            raise MeshError(
                f"{type(model).__name__}.{path} has shape {tuple(x.shape)}, but on this mesh it is laid out as {want} "
                "(padded where the mesh does not divide it): place the model with zoo.parallel.shard(model, mesh)"
            )


def init_arrays(init: Callable[..., Mapping[str, Array]], key: PRNGKeyArray, config: object,
                mesh: object = None) -> dict[str, Array]:  # fmt: skip
    """A family's fresh parameters, ``init(key, shardings, padded)``; with a ``mesh``, every
    array made in place with the sharding :func:`param_shardings` gives it and the
    sizes :func:`layout_sizes` gives its letters: each device computes only its
    shard, with the values of the unsharded init (and zeros in padding)."""
    if mesh is None:
        return dict(init(key, None, None))
    validate_mesh(mesh, config)
    return dict(init(key, param_shardings(config, mesh), layout_sizes(config, mesh)))


def model_arrays(model: str, config: Any, specs: Mapping[str, Param], stacks: Mapping[str, str], *,
                 key: PRNGKeyArray | None, arrays: Mapping[str, Array] | None, mesh: object, dtype) -> Mapping[str, Array]:  # fmt: skip
    """What a family's ``__init__`` builds its model from: ``arrays`` as given (loaded weights),
    or fresh ones from ``key`` (:func:`init_with_stacks`: each layer stack ``{path prefix:
    stacked letter}`` from per-layer keys; with ``mesh``, made in place: :func:`init_arrays`)."""
    if arrays is not None:
        return arrays
    if key is None:
        raise TypeError(f"{model} needs key= (fresh init) or arrays= (loaded weights)")

    def init(k: PRNGKeyArray, shardings: Any, padded: Any) -> dict[str, Array]:
        return init_with_stacks(specs, config.sizes, stacks, key=k, std=config.initializer_range, dtype=dtype,
                                shardings=shardings, padded=padded)  # fmt: skip

    return init_arrays(init, key, config, mesh)
