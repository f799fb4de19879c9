"""Putting a model, its optimizer state and a pipelined stack's layers where the step expects them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from zoo.core.layout import StageOrdered, is_laid_out, model_specs, pad, param_axes, partition_specs, rules_of
from zoo.core.mesh import PIPELINE
from zoo.core.params import map_params
from zoo.errors import ConfigError, MeshError
from zoo.hooks.pipeline import stage_order


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


def param_bytes(tree: PyTree) -> int:
    """Parameter bytes held by one device: the first addressable shard of every array."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def reorder_stacks(tree: PyTree, mesh: Any, virtual: int, *, inverse: bool = False) -> PyTree:
    """Every model in ``tree`` (parameters, an optimizer state's moments) with its pipelined
    stacks in :func:`stage_order` for ``virtual`` chunks per stage on ``mesh``'s ``pipeline``
    axis, as the interleaved schedule needs them; ``inverse``: back to layer order. Arrays keep
    their shardings (one stack at a time crosses the stages once); shape structs pass through.
    The identity for ``virtual=1`` or without a pipeline axis.

    The same types come back: for a training loop that keeps its state in stage order under
    :func:`zoo.hooks.pipeline.stacks_in_stage_order`. Elsewhere use :func:`to_stage_order`,
    whose result says what it is."""
    stages = int(mesh.shape.get(PIPELINE, 1))
    if virtual == 1 or stages == 1:
        return tree

    def reorder(x, order):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.jit(lambda a: a[order], out_shardings=x.sharding)(x)
        return np.asarray(x)[order]

    def sub(m):
        if not is_laid_out(m):  # a model, or a wrapper around one (LoRA's adapters follow its stacks)
            return m
        specs, rules = model_specs(m), rules_of(m)

        def leaf(path, x):
            p = specs[path]
            if not (p.names and p.names[0] in p.stacked
                    and param_axes(p, mesh, rules=rules, sizes=m.config.sizes)[0] == PIPELINE):
                return x
            try:
                order = stage_order(x.shape[0], stages, virtual)
            except MeshError as e:  # which stack: the model's own name for it
                raise MeshError(f"{type(m).__name__}.{path} ({p.names[0]} = {x.shape[0]} as laid out): {e}") from None
            return reorder(x, np.argsort(order) if inverse else order)

        return map_params(leaf, m)

    return jax.tree.map(sub, tree, is_leaf=is_laid_out)


def to_stage_order(tree: PyTree, mesh: Any, virtual: int, *, inverse: bool = False) -> PyTree:
    """Every model in ``tree`` (parameters, gradients, an optimizer state's moments) with its
    pipelined stacks in :func:`stage_order` for ``virtual`` chunks per stage on ``mesh``'s
    ``pipeline`` axis, as the interleaved schedule needs them, each wrapped as a
    :class:`StageOrdered` (which nothing but that schedule's step computes with); ``inverse``:
    each :class:`StageOrdered` back to the model in layer order. The identity for ``virtual=1``
    or without a pipeline axis."""
    stages = int(mesh.shape.get(PIPELINE, 1))
    if virtual == 1 or stages == 1:
        return tree

    def one(m):
        if isinstance(m, StageOrdered):
            if not inverse:
                raise ConfigError(f"to_stage_order: the model is in stage order already ({m.stages} stages x {m.virtual} "
                                  "virtual stages); inverse=True gives it back in layer order")  # fmt: skip
            if (m.stages, m.virtual) != (stages, virtual):
                raise ConfigError(f"to_stage_order(inverse=True): the model is in the stage order of {m.stages} stages x "
                                  f"{m.virtual} virtual stages, not {stages} x {virtual}")  # fmt: skip
            return reorder_stacks(m.model, mesh, virtual, inverse=True)
        if not is_laid_out(m):
            return m
        if inverse:
            raise ConfigError("to_stage_order(inverse=True): the model is in layer order already")
        return StageOrdered(reorder_stacks(m, mesh, virtual), stages, virtual)

    return jax.tree.map(one, tree, is_leaf=lambda x: is_laid_out(x) or isinstance(x, StageOrdered))
