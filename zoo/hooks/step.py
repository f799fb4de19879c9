"""Trace-time hooks that model code calls; each is the identity outside the parallel step.

A model's forward pass runs unchanged on one device and under :func:`zoo.parallel.value_and_grad`'s
``jax.shard_map``. Inside that step these hooks add the collectives the layout needs:

- :func:`gather_layer`: FSDP, all-gather one layer's weights inside the scanned layer body;
- :func:`tensor_psum`: Megatron-style reduction after a head- or hidden-split projection;
- :func:`varying_like` / :func:`sum_to_varying_of`: keep ``shard_map``'s varying-axis types
  right for scan carries and hand-written gradients;
- :func:`remat_policy`: re-gather FSDP weights in the backward pass instead of saving them;
- :func:`context_positions` / :func:`context_gather`: context parallelism, where the
  ``"context"`` axis splits the sequence (see :func:`context_order`).

The expert-parallel dispatch (:func:`zoo.layers.moe.routed_experts`) builds on the same state.
This module knows nothing of meshes' construction or of the step: :mod:`zoo.parallel` enters
:func:`step_context` around the model call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree, Shaped

from zoo.core.mesh import CONTEXT, PIPELINE, WEIGHT_SHARDS, AnyMesh, axis_size
from zoo.core.named import named
from zoo.core.params import is_deferred
from zoo.errors import MeshError

GATHERED = "fsdp_gathered"  # checkpoint name of a layer's all-gathered weights (never saved)
# The product name gather_layer's plans give a layer's routed-experts weights (read by the MoE
# layer's kernel, not by a named zoo.layers.fp8.matmul).
ROUTED_EXPERTS = "routed experts"

# An all-gather whose result is invariant over the axis (each device keeps its block of the
# gradient its group shares, no reduce-scatter). Not public in jax 0.10 to 0.12: its name there.
try:
    from jax.lax import all_gather_invariant as _all_gather_invariant  # type: ignore[attr-defined]
except ImportError:
    try:  # jax 0.10
        from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
    except ImportError:  # jax 0.12
        from jax._src.lax.parallel import _all_gather_invariant


class Gather(NamedTuple):
    """One dimension of a weight the step all-gathers before use: ``dim``, split over mesh
    ``axes`` (outermost first, its ``PartitionSpec`` entry: ``("fsdp", "expert")``);
    ``shared``: those of them whose devices share their tokens (not batch axes of the step),
    gathered as invariant over them, so the gradient is each device's block of the one
    gradient they all computed, where over a batch axis it is the reduce-scatter of theirs."""

    dim: int
    axes: tuple[str, ...] = ("fsdp",)
    shared: tuple[str, ...] = ()


class GatherLater(NamedTuple):
    """The plan of a routed-experts weight (leading with the experts, which no mesh axis
    splits) whose FSDP gather the MoE layer runs itself, one block of experts at a time
    (:func:`zoo.layers.moe.routed_experts`): a layer's gathered experts are most of its
    weights (DeepSeek-V3 671B: 21 GiB in bf16), and with their float32 gradients most of its
    backward pass's transient. ``dims`` as the gather of any other weight."""

    dims: tuple[Gather, ...]


@dataclasses.dataclass(frozen=True)
class VocabSplit:
    """How the step splits the vocabulary: the embedding's and head's rows over ``axis`` (of
    ``devices`` devices, which hold different tokens) and over ``stage_axis`` (of ``stages``
    devices, the pipeline stages, which share their tokens); each device holds a contiguous
    block (stage-major: device ``(p, f)`` block ``p·devices + f``, padded rows last),
    ``vocab_size`` of them real (:mod:`zoo.vocab_parallel`). ``axis`` is ``None`` where only
    the stages split it."""

    axis: str | None
    devices: int
    vocab_size: int
    stage_axis: str | None = None
    stages: int = 1

    @property
    def spec(self) -> str | tuple[str, ...]:
        """The vocabulary dimension's entry of the blocks' ``PartitionSpec``."""
        axes = tuple(a for a in (self.stage_axis, self.axis) if a is not None)
        return axes[0] if len(axes) == 1 else axes



@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """How the step pipelines the layer stacks: ``stages`` devices on the ``"pipeline"`` axis,
    each holding a contiguous block of every pipelined stack's layers (padding last), and
    ``microbatches`` micro-batches of each device's rows passed stage to stage
    (:mod:`zoo.pipeline`). ``layers``: per pipelined stack (by its tree structure), its real
    layer count (layers past it are padding, skipped). ``virtual``: each stage's layers are
    that many chunks, the stacks stored in :func:`zoo.pipeline.stage_order`. ``schedule``:
    ``"gpipe"`` (autodiff makes the backward pass) or ``"1f1b"``."""

    stages: int
    microbatches: int
    layers: dict[Any, int]
    virtual: int = 1  # chunks per stage (the interleaved schedule): the stacks are in stage order
    schedule: str = "gpipe"  # or "1f1b" (zoo.parallel.one_f_one_b): the training step's backward inside the ticks


@dataclasses.dataclass
class _Step:
    mesh: AnyMesh
    plans: dict[Any, Any]  # layer treedef -> per leaf, the Gather of each dimension gathered
    gathered: set[Any]
    vocab: VocabSplit | None = None
    pipeline: PipelineSplit | None = None
    # Weights gather_layer left to the MoE layer: id -> (the local block, its gather's dims), and
    # those the MoE layer took (the step refuses a model that left one ungathered).
    later: dict[int, tuple[Any, tuple[Gather, ...]]] = dataclasses.field(default_factory=dict)
    later_taken: set[int] = dataclasses.field(default_factory=set)
    # The model's layout rules (letter -> AxisRule): where a weight computed inside the step (a
    # quantized base's, zoo.lora) finds the block of it this device holds.
    rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Per layer treedef, each leaf's product (Param.matmul): gather_layer leaves the weights of
    # the products named by gathered_by_product to them, passing the model code a stand-in of
    # the gathered shape: id -> (stand-in, the local block, its gather's dims), and those taken.
    products: Mapping[Any, tuple[str | None, ...]] = dataclasses.field(default_factory=dict)
    deferred: dict[int, tuple[Any, Any, tuple[Gather, ...]]] = dataclasses.field(default_factory=dict)
    deferred_taken: set[int] = dataclasses.field(default_factory=set)


# The products that gather their own weights (zoo.layers.fp8: a tensorwise FP8 product gathers
# its weight's FP8 codes); entered by zoo.layers.fp8.using.
_BY_PRODUCT: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("zoo_gathered_by_product", default=frozenset())


@contextlib.contextmanager
def gathered_by_product(names: frozenset[str] | set[str]) -> Iterator[None]:
    """Within it, :func:`gather_layer` leaves a layer weight whose product
    (:attr:`zoo.core.params.Param.matmul`) is one of ``names`` to that product, which gathers it
    itself (:func:`deferred_gather`): :func:`zoo.layers.fp8.matmul` gathers a tensorwise FP8
    product's weight as its FP8 codes, half a bfloat16 gather's bytes. The model code gets a
    stand-in of the gathered weight's shape and dtype, filled with NaN: nothing computes it (XLA
    drops it unread), and a reader other than the product would make the loss NaN, not wrong."""
    token = _BY_PRODUCT.set(frozenset(names))
    try:
        yield
    finally:
        _BY_PRODUCT.reset(token)


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("zoo_parallel_step", default=None)


def _varying(x) -> frozenset[str]:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _psum(x, axes: Sequence[str]):
    axes = tuple(a for a in axes if a in _varying(x))
    return jax.lax.psum(x, axes) if axes else x


def in_step() -> bool:
    """Whether the current trace is inside :func:`value_and_grad`'s ``shard_map``."""
    return _STEP.get() is not None


def tensor_psum(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """Sum the partial results of a head- or hidden-split projection over ``"tensor"``.

    Called on the output of ``wo`` and ``w_down``: with heads / hidden units split, each
    device holds a partial sum of the full product (Megatron's row-parallel layer).
    """
    if _STEP.get() is None:
        return x
    return _psum(x, ("tensor",))


def gather_layer(tree: PyTree) -> PyTree:
    """FSDP: one layer's weights all-gathered over ``"fsdp"`` and, where the expert group
    joins it on them, ``"expert"`` (:data:`zoo.core.mesh.WEIGHT_SHARDS`); call inside the
    scanned body.

    Only this layer's full weights exist at a time; the step's remat policy re-gathers them
    for the backward pass instead of saving them, and autodiff turns the transpose of the
    tiled all-gather into a reduce-scatter of the gradients (over the axes that split the
    batch; over one the batch is not split on, each device keeps its block of the gradient
    they share). Tensor-split dimensions and the routed experts' expert dimension stay split. Call it on the weights already cast to the compute dtype: the
    gather then moves half the bytes in bf16, and nothing derived from the full weights is
    left for the backward pass to save (the reduce-scatter runs in the compute dtype too).
    """
    step = _STEP.get()
    if step is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    plan = step.plans.get(treedef)
    if plan is None:
        raise MeshError(f"gather_layer: {type(tree).__name__} is not a layer stack of the model in this step")
    step.gathered.add(treedef)
    by_product, products = _BY_PRODUCT.get(), step.products.get(treedef, ())
    out = []
    for i, (x, d) in enumerate(zip(leaves, plan)):
        if isinstance(d, GatherLater):  # the MoE layer gathers it, a block of experts at a time
            step.later[id(x)] = (x, d.dims)
            out.append(x)
        elif d and i < len(products) and products[i] in by_product:  # its product gathers it (in FP8)
            if products[i] == ROUTED_EXPERTS:  # zoo.layers.moe.routed_experts gathers it (gathered_later)
                step.later[id(x)] = (x, tuple(d))
                out.append(x)
                continue
            stand_in = jnp.full(gathered_shape(x, d), jnp.nan, x.dtype)
            step.deferred[id(stand_in)] = (stand_in, x, tuple(d))
            out.append(stand_in)
        else:
            out.append(named(GATHERED, gather_fsdp, x, d))
    return jax.tree.unflatten(treedef, out)


def gathered_later(w: Shaped[Array, "..."]) -> tuple[Gather, ...] | None:
    """The gather :func:`gather_layer` left undone on ``w`` (a routed-experts weight's local
    block; :class:`GatherLater`), for its one reader to run block by block; ``None`` where
    ``w`` is whole (gathered, or outside the step)."""
    step = _STEP.get()
    entry = None if step is None else step.later.get(id(w))
    if entry is None or entry[0] is not w:
        return None
    step.later_taken.add(id(w))
    return entry[1]


def gathered_by(product: str) -> bool:
    """Whether the traces within :func:`gathered_by_product` leave ``product``'s weights to it
    (:data:`ROUTED_EXPERTS`: the MoE layer's)."""
    return product in _BY_PRODUCT.get()


def deferred_gather(w: Shaped[Array, "..."]) -> tuple[Shaped[Array, "..."], tuple[Gather, ...]] | None:
    """Where ``w`` is the stand-in :func:`gather_layer` gave for a weight its product gathers
    (:func:`gathered_by_product`): the device's block of the weight and the gather's dims;
    ``None`` for any other array."""
    step = _STEP.get()
    entry = None if step is None else step.deferred.get(id(w))
    if entry is None or entry[0] is not w:
        return None
    step.deferred_taken.add(id(w))
    return entry[1], entry[2]


def gathered_shape(w: Shaped[Array, "..."], dims: Sequence[Gather]) -> tuple[int, ...]:
    """The shape of ``w`` (a device's block) once :func:`gather_fsdp` has gathered it on ``dims``."""
    step = _STEP.get()
    shape = list(w.shape)
    for g in dims:
        for a in g.axes:
            shape[g.dim] *= 1 if step is None else axis_size(step.mesh, a)
    return tuple(shape)


def gather_fsdp(x, dims: Sequence[int | Gather]):
    """``x`` all-gathered (tiled) on each of ``dims``: a :class:`Gather`, or a dimension split
    over ``"fsdp"`` alone. Axes that split the batch are gathered together in one collective,
    the innermost group first; the devices of a ``shared`` axis, which compute the same
    gradient, get their block of it back instead of a reduce-scatter."""
    for g in dims:
        g = Gather(g) if isinstance(g, int) else g
        groups: list[tuple[list[str], bool]] = []  # innermost first
        for a in reversed(g.axes):
            shared = a in g.shared
            if groups and groups[-1][1] == shared:
                groups[-1][0].insert(0, a)
            else:
                groups.append(([a], shared))
        for axes, shared in groups:
            name = axes[0] if len(axes) == 1 else tuple(axes)
            x = (_all_gather_invariant if shared else jax.lax.all_gather)(x, name, axis=g.dim, tiled=True)
    return x


# -- context parallelism ----------------------------------------------------------------------


def context_order(seq_len: int, n: int) -> np.ndarray:
    """The order a sequence is laid out in over ``n`` context devices: cut into ``2n`` chunks,
    device i holds chunks i and 2n-1-i (Llama 3's layout), so every device has as much causal
    attention work as the others. ``x[:, order]`` puts device i's tokens at ``[i·S/n, (i+1)·S/n)``."""
    if seq_len % (2 * n):
        raise MeshError(
            f"context={n} cuts a sequence into {2 * n} equal chunks: seq_len {seq_len} is not divisible by {2 * n}"
        )
    c = seq_len // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def context_size() -> int:
    """How many devices split the sequence in the current step (1 outside it)."""
    step = _STEP.get()
    return 1 if step is None else axis_size(step.mesh, CONTEXT)


def context_positions(seq_len: int) -> Int[Array, " S"]:
    """Each local position's index in the whole sequence: ``0..S-1`` outside context
    parallelism; inside, the indices of this device's two chunks (:func:`context_order`)."""
    n = context_size()
    if n == 1:
        return jnp.arange(seq_len, dtype=jnp.int32)
    i = jax.lax.axis_index(CONTEXT)
    c = seq_len // 2
    j = jnp.arange(seq_len, dtype=jnp.int32)
    chunk = jnp.where(j < c, i, 2 * n - 1 - i)
    return (chunk * c + j % c).astype(jnp.int32)


def context_sum(x: Shaped[Array, "*shape"]) -> Shaped[Array, "*shape"]:
    """A per-sequence statistic of the local tokens summed over the devices holding the
    sequence's other chunks (outside context parallelism, ``x``)."""
    if context_size() == 1:
        return x
    return _psum(x, (CONTEXT,))


def context_gather(x: Shaped[Array, "B S *rest"]) -> Shaped[Array, "B T *rest"]:
    """The whole sequence of ``x`` (axis 1) in natural order, from every context device's
    chunks: an all-gather whose transpose (autodiff) reduce-scatters the gradients back.
    Outside context parallelism, ``x``."""
    n = context_size()
    if n == 1:
        return x
    full = jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)
    return jnp.take(full, np.argsort(context_order(full.shape[1], n)), axis=1)


def remat_policy(policy: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """The remat policy for a scanned layer body inside the step.

    Without a placement map XLA would keep every layer's gathered weights for the backward
    pass (a full copy of the model): this policy saves everything else and re-gathers them.
    A placement map's policy already saves only named tensors, so it is kept as is.
    """
    step = _STEP.get()
    if step is None or policy is not None or all(axis_size(step.mesh, a) == 1 for a in WEIGHT_SHARDS):
        return policy
    return _regather


def _regather(prim, *avals, **params) -> bool:
    """Save anything but the FSDP all-gathers' outputs (over ``fsdp`` and the expert group,
    which joins it on the weights outside the experts) and the name on them. (Written out:
    ``jax.checkpoint_policies.save_anything_except_these_names`` saves everything in jax 0.10.)"""
    if prim is jax.lax.all_gather_p or prim.name == "all_gather_invariant":
        names = params.get("axis_name", ())
        return not set(names if isinstance(names, tuple) else (names,)) & set(WEIGHT_SHARDS)
    return not (prim.name == "name" and params.get("name") == GATHERED)


def varying_over(x: Shaped[Array, "*shape"] | None, axes: Sequence[str]) -> Shaped[Array, "*shape"] | None:
    """``x`` cast to varying over those of ``axes`` it does not vary over yet (inside
    ``shard_map``; ``None`` stays ``None``). The cast's transpose sums the gradient over those
    axes: a value used on every device's shard gets its total."""
    if x is None:
        return x
    missing = tuple(a for a in axes if a not in _varying(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def varying_like(x: Shaped[Array, "*shape"], *likes: Array) -> Shaped[Array, "*shape"]:
    """``x`` typed as varying over the mesh axes any of ``likes`` varies over.

    A scan carry that starts as a constant (a zero accumulator) and accumulates per-device
    values must start with the type it ends with; outside the step, ``x`` unchanged.
    """
    if _STEP.get() is None:
        return x
    axes = tuple(sorted(frozenset().union(*(_varying(like) for like in likes)) - _varying(x)))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def sum_to_varying_of(x: Float[Array, "*shape"], like: Array) -> Float[Array, "*shape"]:
    """``x`` summed over the mesh axes it varies over and ``like`` does not: the transpose of
    :func:`varying_like`, for a hand-written gradient of an operand that was used varying
    (``jax.custom_vjp`` must return each cotangent with its primal's type)."""
    if _STEP.get() is None:
        return x
    axes = tuple(sorted(_varying(x) - _varying(like)))
    return jax.lax.psum(x, axes) if axes else x


def global_sum(x: Shaped[Array, "*shape"]) -> Shaped[Array, "*shape"]:
    """``x`` summed over every mesh axis it varies over: inside the step, the whole batch's
    total of a per-device statistic (a balance loss that is not a mean of per-token terms
    needs the global counts); outside, ``x``."""
    if _STEP.get() is None:
        return x
    axes = tuple(sorted(_varying(x)))
    return jax.lax.psum(x, axes) if axes else x


def vocab_split() -> VocabSplit | None:
    """How the current step splits the vocabulary (``None``: kept whole, or outside the step)."""
    step = _STEP.get()
    return None if step is None else step.vocab


def pipeline_of(stacked: PyTree) -> tuple[PipelineSplit, int] | None:
    """``(split, real layer count)`` where ``stacked`` is a layer stack the current step
    pipelines over ``"pipeline"``; ``None`` otherwise (outside the step, or a stack kept whole)."""
    step = _STEP.get()
    if step is None or step.pipeline is None:
        return None
    n = step.pipeline.layers.get(stack_structure(stacked))
    return None if n is None else (step.pipeline, n)


def stack_structure(stacked: PyTree) -> Any:
    """A layer stack's tree structure, each :class:`zoo.core.params.Deferred` weight (a LoRA
    update, a quantized base) as the one leaf it stands for: how the step knows a stack."""
    return jax.tree.structure(stacked, is_leaf=is_deferred)


def block_of(x: Shaped[Array, "..."], dim: int, axes: Sequence[str]) -> Shaped[Array, "..."]:
    """The block of ``x`` on ``dim`` that this device holds where ``axes`` (outermost first)
    split that dimension, inside the step (``x`` itself outside it, or with no axes)."""
    step = _STEP.get()
    if step is None or not axes:
        return x
    index, n = 0, 1
    for a in axes:
        index, n = index * axis_size(step.mesh, a) + jax.lax.axis_index(a), n * axis_size(step.mesh, a)
    if x.shape[dim] % n:
        raise MeshError(f"block_of: dimension {dim} of shape {tuple(x.shape)} does not split into {n} blocks over {tuple(axes)}")
    size = x.shape[dim] // n
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)


def current_step() -> _Step | None:
    """The step being traced (mesh and FSDP plans), or ``None`` outside it."""
    return _STEP.get()


@contextlib.contextmanager
def step_context(
    mesh: AnyMesh, plans: dict[Any, Any], vocab: VocabSplit | None = None, pipeline: PipelineSplit | None = None,
    rules: Mapping[str, Any] | None = None, products: Mapping[Any, tuple[str | None, ...]] | None = None,
) -> Iterator[_Step]:
    """Trace the model inside the parallel step: the hooks see ``mesh``, the FSDP ``plans``, how
    the vocabulary is split, how the layer stacks are pipelined, the model's layout ``rules`` and
    each layer leaf's product (``products``, as ``plans`` per layer treedef)."""
    ctx = _Step(mesh, plans, set(), vocab, pipeline, rules=dict(rules or {}), products=dict(products or {}))
    token = _STEP.set(ctx)
    try:
        yield ctx
    finally:
        _STEP.reset(token)


def varying_axes(x) -> frozenset[str]:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    return _varying(x)


def psum_varying(x, axes: Sequence[str]):
    """``psum`` over those of ``axes`` that ``x`` varies over."""
    return _psum(x, axes)


__all__ = [
    "CONTEXT", "GATHERED", "PIPELINE", "ROUTED_EXPERTS", "Gather", "GatherLater", "PipelineSplit", "axis_size", "block_of", "context_gather", "context_order", "context_positions",
    "context_size", "context_sum", "current_step", "deferred_gather", "gather_fsdp", "gather_layer", "gathered_by", "gathered_by_product", "gathered_later",
    "gathered_shape", "global_sum", "in_step", "pipeline_of",
    "psum_varying", "remat_policy", "stack_structure", "step_context", "sum_to_varying_of", "tensor_psum", "varying_axes", "varying_like",
    "varying_over", "VocabSplit", "vocab_split",
]  # fmt: skip
