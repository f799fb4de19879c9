"""Mixture-of-experts machinery shared by every MoE family: dropless expert compute on the
(token, expert) pairs a router chose, and expert parallelism's dispatch and combine (its
all-to-all rounds: :mod:`zoo.layers.moe_dispatch`).

Routing is the family's own (DeepSeek-V3's sigmoid + bias + groups, Qwen3's softmax top-k): it
produces a :class:`Routing`, and everything after it is here.

Dimension letters: T tokens · D model width · E routed experts · M expert hidden ·
K experts per token (top-k) · P (token, expert) pairs · R sorted rows · Dw, Mw: the experts'
``D`` and ``M`` as the layer is handed them (a device's FSDP block inside a step that gathers
them a block of experts at a time: :func:`_experts_in_blocks`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo.core.mesh import axis_size
from zoo.core.named import named
from zoo.errors import ConfigError, MeshError
from zoo.hooks.step import (
    GATHERED,
    ROUTED_EXPERTS,
    Gather,
    current_step,
    gather_fsdp,
    gathered_by,
    gathered_later,
    psum_varying,
    remat_policy,
    varying_axes,
    varying_like,
)
from zoo.layers import expert_products as ep
from zoo.layers import fp8
from zoo.layers.capacity_mlp import MATMULS, OVERFLOW_TILE, capacity_expert_mlp, capacity_for, capacity_layout
from zoo.layers.grouped_matmul import grouped_matmul, tile_layout
from zoo.layers.moe_dispatch import Dispatch, exchange_experts, traced_platform
from zoo.layers.rows import take_rows
from zoo.layers.stack import layer_policy_now

ExpertImpl = Literal["auto", "ragged_dot", "capacity", "grouped", "tiled", "dense"]
# The most bytes of routed-expert weights an FSDP step gathers at once where no mesh axis
# splits the experts: the three projections of a block of experts, in the compute dtype
# (:func:`expert_blocks`). DeepSeek-V3 671B's 21 GiB a layer is 16 blocks of 16 experts.
EXPERT_BLOCK_BYTES = 2 * 2**30


class Routing(NamedTuple):
    """Which experts each token goes to, with what weight; and the scores behind it."""

    experts: Int[Array, "T K"]
    weights: Float[Array, "T K"]
    scores: Float[Array, "T E"]


def expert_load(experts: Int[Array, "T K"], n_experts: int) -> Int[Array, " E"]:
    """Tokens routed to each expert."""
    return jnp.zeros(n_experts, jnp.int32).at[experts.reshape(-1)].add(1)


def sorted_expert_mlp(
    rows: Float[Array, "R D"],
    group_sizes: Int[Array, " E"],
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
    matmul: Callable[..., Array],
) -> Float[Array, "R D"]:
    """Each expert's SwiGLU on its contiguous rows (``group_sizes[e]`` rows of expert ``e``,
    then padding rows whose output is zero), through a grouped ``matmul(rows, w, sizes)``."""
    gate = named("moe_gate", matmul, rows, w_gate, group_sizes)
    up = named("moe_up", matmul, rows, w_up, group_sizes)
    hidden = named("moe_hidden", lambda: jax.nn.silu(gate) * up)
    return matmul(hidden, w_down, group_sizes)


def expert_pair_mlp(
    x: Float[Array, "T D"],
    pair_experts: Int[Array, " P"],
    k: int,
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
    *,
    matmul: Callable[..., Array],
    expected_rows: int | None = None,
) -> Float[Array, "P D"]:
    """The output of every (token ``p // k``, expert ``pair_experts[p]``) pair, in pair order.

    The pairs are sorted by expert, run through :func:`sorted_expert_mlp` and unsorted (a
    gather, not a scatter-add). An expert id of ``E`` marks a pair that is not this call's
    (expert parallelism: another device's expert): it sorts last, is skipped, and gives zeros.
    (``expected_rows``, the real rows among the ``P``, is for :func:`capacity_pair_mlp`: a
    grouped matmul's work follows the real rows whatever it is told.)
    """
    e = w_gate.shape[0]
    order = jnp.argsort(pair_experts, stable=True)
    sizes = jnp.bincount(pair_experts, length=e + 1)[:e]
    out = sorted_expert_mlp(jnp.take(x, order // k, axis=0), sizes, w_gate, w_up, w_down, matmul)
    return jnp.take(out, jnp.argsort(order), axis=0)


def capacity_pair_mlp(
    x: Float[Array, "T D"],
    pair_experts: Int[Array, " P"],
    k: int,
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
    *,
    expected_rows: int | None = None,
    capacity: int | None = None,
    recipes: tuple[str, str, str] | None = None,
    codes: ep.ExpertCodes | None = None,
    rows: ep.RowCodes | None = None,
) -> Float[Array, "P D"]:
    """:func:`expert_pair_mlp` through :func:`zoo.layers.capacity_mlp.capacity_expert_mlp`:
    every expert's first ``capacity`` rows as one batched matmul, the rest through the tile
    loop; dropless. ``capacity`` defaults to :func:`zoo.layers.capacity_mlp.capacity_for` the
    ``expected_rows`` real rows (default all ``P``; expert parallelism's buffers are mostly
    other devices' pairs or padding). ``recipes``: the gate, up and down projections' FP8
    recipes (default: the active precision map's, :data:`MATMULS`). ``codes``: the weights
    gathered as FP8 codes, the three weights their stand-ins
    (:func:`zoo.layers.expert_products.gather_codes`). ``rows``: ``x``'s rows as the dispatch sent
    them in FP8, ``x`` their stand-in (:func:`zoo.layers.moe_dispatch.exchange_experts`)."""
    e = w_gate.shape[0]
    c = capacity or capacity_for(expected_rows or pair_experts.shape[0], e)
    if recipes is None:
        recipes = tuple(fp8.recipe_of(name) for name in MATMULS)  # the active precision map's (FP8 or not)
    layout = capacity_layout(pair_experts, e, c)
    return capacity_expert_mlp(x, w_gate, w_up, w_down, layout, k, OVERFLOW_TILE, recipes, codes, rows)


def _routed_experts_pairs(pair_mlp, x, routing, w_gate, w_up, w_down):
    """``pair_mlp`` on the T·K routed pairs, then each token's K outputs combined."""
    t, k = routing.experts.shape
    out = pair_mlp(x, routing.experts.reshape(-1), k, w_gate, w_up, w_down)
    out = named("moe_out", out.reshape, t, k, -1)
    return jnp.einsum("tkd,tk->td", out, routing.weights.astype(out.dtype))


def _routed_experts_sorted(matmul, x, routing, w_gate, w_up, w_down):
    """:func:`expert_pair_mlp` with grouped ``matmul`` on the routed pairs, combined."""
    return _routed_experts_pairs(functools.partial(expert_pair_mlp, matmul=matmul), x, routing, w_gate, w_up, w_down)


def routed_experts_ragged(
    x: Float[Array, "T D"],
    routing: Routing,
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
) -> Float[Array, "T D"]:
    """Dropless: each expert's SwiGLU on its rows as ``jax.lax.ragged_dot`` grouped matmuls
    (a native grouped-matmul kernel on TPU). No capacity, no token dropped."""
    return _routed_experts_sorted(jax.lax.ragged_dot, x, routing, w_gate, w_up, w_down)


def routed_experts_capacity(
    x: Float[Array, "T D"],
    routing: Routing,
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
) -> Float[Array, "T D"]:
    """Dropless: every expert's first rows (up to a static capacity, 1.25x the mean) as one
    batched matmul, the rows past it through the tile loop (:func:`capacity_pair_mlp`)."""
    return _routed_experts_pairs(capacity_pair_mlp, x, routing, w_gate, w_up, w_down)


def routed_experts_grouped(
    x: Float[Array, "T D"],
    routing: Routing,
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
) -> Float[Array, "T D"]:
    """Dropless: each expert's SwiGLU on its rows through :func:`zoo.layers.grouped_matmul`, a
    loop over row tiles whose work follows the routing (CPU and GPU)."""
    return _routed_experts_sorted(grouped_matmul, x, routing, w_gate, w_up, w_down)


def routed_experts_tiled(
    x: Float[Array, "T D"],
    routing: Routing,
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
) -> Float[Array, "T D"]:
    """Dropless grouped matmuls from plain gathers and one batched einsum per projection.

    The T·K (token, expert) pairs are sorted by expert and cut into tiles of ``tile`` rows,
    each tile owned by one expert (an expert's last tile is padded). With ``tile`` the mean
    rows per expert there are at most 2E tiles whatever the routing, so the static shapes cost
    at most twice the routed FLOPs and a transient copy of twice the expert weights — against
    E/K times the FLOPs for the dense path. (``jax.lax.ragged_dot`` is lowered natively on
    TPU only; on CPU and CUDA, jaxlib 0.10 expands it to a masked dense product.)
    """
    t, k = routing.experts.shape
    e = w_gate.shape[0]
    rows = t * k
    tile = max(8, -(-rows // e))
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tiles = tile_layout(expert_load(routing.experts, e), rows, tile)
    n_tiles, owner = tiles.owner.shape[0], tiles.owner
    offset = jnp.arange(tile, dtype=jnp.int32)[None, :]
    valid = offset < tiles.valid[:, None]
    sorted_pos = jnp.where(valid, tiles.first_row[:, None] + offset, 0)
    tokens = jnp.take(order // k, sorted_pos)
    xt = take_rows(x, tokens, valid)
    gate = named("moe_gate", lambda: jnp.einsum("ntd,ndm->ntm", xt, jnp.take(w_gate, owner, axis=0)))
    up = named("moe_up", lambda: jnp.einsum("ntd,ndm->ntm", xt, jnp.take(w_up, owner, axis=0)))
    hidden = named("moe_hidden", lambda: jax.nn.silu(gate) * up)
    out = jnp.einsum("ntm,nmd->ntd", hidden, jnp.take(w_down, owner, axis=0)).reshape(n_tiles * tile, -1)
    # Where each (token, k) pair landed: its rank in the sort gives its expert's tile and slot.
    within = jnp.argsort(order) - tiles.group_first_row[flat]
    slot = (tiles.group_first_tile[flat] + within // tile) * tile + within % tile
    # The combine weights' gradient needs each expert's output: naming it spares the down projection.
    out = named("moe_out", lambda: jnp.take(out, slot, axis=0).reshape(t, k, -1))
    return jnp.einsum("tkd,tk->td", out, routing.weights.astype(out.dtype))


def routed_experts_dense(
    x: Float[Array, "T D"],
    routing: Routing,
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
) -> Float[Array, "T D"]:
    """Reference path: every expert on every token, combined with the routing weights
    (zero for experts not chosen). E/K times the work of the dropless path."""
    combine = jnp.zeros(routing.scores.shape, x.dtype)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], routing.experts].set(routing.weights.astype(x.dtype))
    gate = named("moe_gate", jnp.einsum, "td,edm->tem", x, w_gate)
    up = named("moe_up", jnp.einsum, "td,edm->tem", x, w_up)
    hidden = named("moe_hidden", lambda: jax.nn.silu(gate) * up)
    return jnp.einsum("tem,emd,te->td", hidden, w_down, combine)


EXPERT_IMPLS = {
    "ragged_dot": routed_experts_ragged,
    "capacity": routed_experts_capacity,
    "grouped": routed_experts_grouped,
    "tiled": routed_experts_tiled,
    "dense": routed_experts_dense,
}


def pair_mlp_for(impl: str) -> Callable[..., Float[Array, "P D"]]:
    """The pair MLP (:func:`expert_pair_mlp`'s signature) of expert path ``impl`` under expert
    parallelism, which runs every path's experts on (token, expert) pairs: the batched capacity
    pass for ``"capacity"``, XLA's ``ragged_dot`` for ``"ragged_dot"``, zoo's
    :func:`grouped_matmul` for the others."""
    path = resolve_expert_impl(impl)
    if path == "capacity":
        # The recipes as the map gives them now: the dispatch's later rounds call it again in the
        # backward pass, traced after the model's call has left the map's context.
        return functools.partial(capacity_pair_mlp, recipes=tuple(fp8.recipe_of(name) for name in MATMULS))
    matmul = jax.lax.ragged_dot if path == "ragged_dot" else grouped_matmul
    return functools.partial(expert_pair_mlp, matmul=matmul)


def resolve_expert_impl(impl: str) -> str:
    """``auto``: ``ragged_dot`` where XLA has a grouped-matmul lowering for it (TPU), else
    ``capacity`` (a batched matmul over a static capacity; 1.5-1.7x faster than ``grouped`` on
    CPU, benchmarks/moe.py; cuBLAS's strong shape on GPU, not yet measured there). The platform
    is the trace's (:func:`zoo.layers.moe_dispatch.traced_platform`: the planner's trace for a
    GPU is a GPU's, on whatever machine it runs)."""
    if impl == "auto":
        return "ragged_dot" if traced_platform() == "tpu" else "capacity"
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"expert_impl must be one of {['auto', *EXPERT_IMPLS]}, got {impl!r}")
    return impl


def expert_blocks(experts: int, gathered_bytes: int, limit: int | None = None) -> int:
    """The blocks a layer's routed experts are gathered in: the fewest that divide ``experts``
    with each block's share of ``gathered_bytes`` at most ``limit`` (default
    :data:`EXPERT_BLOCK_BYTES`; one expert a block at most)."""
    limit = EXPERT_BLOCK_BYTES if limit is None else limit
    return next((n for n in range(1, experts + 1) if experts % n == 0 and gathered_bytes <= n * limit), experts)


def _experts_in_blocks(
    impl: Callable[..., Float[Array, "T D"]],
    pair_mlp: Callable[..., Float[Array, "P D"]],
    x: Float[Array, "T D"],
    routing: Routing,
    weights: tuple[Float[Array, "E Dw Mw"], Float[Array, "E Dw Mw"], Float[Array, "E Mw Dw"]],
    dims: list[tuple[Gather, ...]],
) -> Float[Array, "T D"]:
    """The routed experts' combined output, their weights gathered a block of experts at a time
    (:class:`zoo.hooks.step.GatherLater`; ``weights`` are this device's blocks, ``dims`` their
    gathers). One block (:func:`expert_blocks`): gathered whole, through ``impl`` as without
    blocks. More: a loop over the blocks, each gathering its experts' weights, running its pairs
    through ``pair_mlp`` (the other blocks' marked as not its own: zeros; ``moe_out`` is the
    block's rows) and adding their combination to a float32 ``[T, D]`` sum. Checkpointed as the
    layer body is, so the backward pass re-gathers each block and reduce-scatters its gradient
    before the next: one block's gathered weights and float32 gradients are what the layer
    holds, not every expert's. Combined inside the block, nothing after the loop needs the
    blocks' rows, so the layer's recomputed forward pass leaves the loop out (two gathers of
    each block a step, not three)."""
    step = current_step()
    t, k = routing.experts.shape
    e = weights[0].shape[0]
    gathered = sum(w.size * w.dtype.itemsize * math.prod(axis_size(step.mesh, g.axes) for g in d)
                   for w, d in zip(weights, dims))  # fmt: skip
    n = expert_blocks(e, gathered)
    in_codes = gathered_by(ROUTED_EXPERTS)  # gathered as FP8 codes (tensorwise routed experts)

    def gather(local):  # a block's weights (stand-ins, with the codes the pair MLP reads) and its pair MLP
        if not in_codes:
            return [named(GATHERED, gather_fsdp, w, d) for w, d in zip(local, dims)], pair_mlp
        stand_ins, codes = ep.gather_codes(local, dims)
        return list(stand_ins), functools.partial(pair_mlp, codes=codes)

    if n == 1:
        ws, mlp = gather(weights)
        x, combine = (varying_like(a, ws[0]) for a in (x, routing.weights))
        routing = routing._replace(weights=combine)
        out = _routed_experts_pairs(mlp, x, routing, *ws) if in_codes else impl(x, routing, *ws)
        return psum_varying(out, ("tensor",))
    g = e // n
    flat = routing.experts.reshape(-1)
    x, combine = (varying_like(a, weights[0]) for a in (x, routing.weights))

    def block(out, at):
        i, local = at
        ws, mlp = gather(local)
        ids = flat - i * g
        ids = jnp.where((ids >= 0) & (ids < g), ids, g)  # g: another block's pair (zeros)
        rows = named("moe_out", mlp(x, ids, k, *ws, expected_rows=-(-t * k // n)).reshape, t, k, -1)
        mixed = jnp.einsum("tkd,tk->td", rows, combine.astype(rows.dtype), preferred_element_type=jnp.float32)
        return out + mixed, None

    policy = layer_policy_now() or remat_policy(None)
    body = block if policy is None else jax.checkpoint(block, policy=policy, prevent_cse=False)
    init = varying_like(jnp.zeros((t, x.shape[-1]), jnp.float32), x, weights[0])
    blocks = tuple(w.reshape(n, g, *w.shape[1:]) for w in weights)
    out, _ = jax.lax.scan(body, init, (jnp.arange(n, dtype=flat.dtype), blocks))
    return psum_varying(out.astype(x.dtype), ("tensor",))


def routed_experts(
    impl: Callable[..., Float[Array, "T D"]],
    x: Float[Array, "T D"],
    routing: Routing,
    w_gate: Float[Array, "E Dw M"],
    w_up: Float[Array, "E Dw M"],
    w_down: Float[Array, "E Mw Dw"],
    *,
    pair_mlp: Callable[..., Float[Array, "P D"]],
    dispatch: Dispatch = Dispatch(),
    fp8_rows: bool = False,
) -> tuple[Float[Array, "T D"], Int[Array, ""]]:
    """The routed experts' combined output, expert-parallel inside the step; and the (token,
    expert) pairs dropped past the dispatch's capacity (0 unless ``dispatch.overflow="drop"``).

    Outside the step (or with experts not split over ``"expert"``) this is ``impl``; where the
    step left the experts' FSDP gather to this layer (:class:`zoo.hooks.step.GatherLater`),
    ``pair_mlp`` a block of experts at a time (:func:`_experts_in_blocks`). Split,
    each device holds ``E / expert`` experts (and, with ``"tensor"``, a slice of their hidden
    units) and computes only the (token, expert) pairs routed to them: ``pair_mlp(x,
    pair_experts, k, w_gate, w_up, w_down)`` (:func:`expert_pair_mlp`) runs
    each pair ``(p // k, pair_experts[p])`` through its local expert, an id of ``E / expert``
    marking a pair that is not the device's (skipped, zeros).

    - Tokens split over ``"expert"`` (a batch split over it): **all-to-all dispatch** in rounds
      of ``dispatch.capacity_factor`` x the mean rows per destination
      (:func:`zoo.layers.moe_dispatch.exchange_experts`); the outputs come back by the reverse
      all-to-all and are combined where the tokens live. ``fp8_rows``: the tokens' rows travel
      as their FP8 codes (``pair_mlp`` the capacity kernel with tensorwise gate and up projections).
    - Tokens shared by the expert group (the batch split over ``data``/``fsdp`` only): no move;
      each device picks its own pairs, and a ``psum`` over ``"expert"`` combines.
    """
    none = jnp.zeros((), jnp.int32)
    step = current_step()
    if step is None:
        return impl(x, routing, w_gate, w_up, w_down), none
    if "expert" not in varying_axes(w_gate):
        dims = [gathered_later(w) for w in (w_gate, w_up, w_down)]
        if any(d is not None for d in dims):
            if not all(d is not None for d in dims):
                raise MeshError("routed_experts: some of the routed experts' weights are gathered, others not")
            return _experts_in_blocks(impl, pair_mlp, x, routing, (w_gate, w_up, w_down), dims), none
        x, weights = (varying_like(a, w_gate) for a in (x, routing.weights))
        return psum_varying(impl(x, routing._replace(weights=weights), w_gate, w_up, w_down), ("tensor",)), none
    later = [gathered_later(w) for w in (w_gate, w_up, w_down)]
    if any(d is not None for d in later):  # gather_layer left their FSDP gather to us: as FP8 codes
        if not all(d is not None for d in later):
            raise MeshError("routed_experts: some of the routed experts' weights are gathered, others not")
        (w_gate, w_up, w_down), codes = ep.gather_codes((w_gate, w_up, w_down), later)
        extra = {"codes": codes}
    else:
        extra = {}
    t, k = routing.experts.shape
    e_local = w_gate.shape[0]
    flat = routing.experts.reshape(-1)
    spread = "expert" in varying_axes(x)
    if spread:
        out, dropped = exchange_experts(pair_mlp, x, flat, k, (w_gate, w_up, w_down), dispatch, extra, fp8_rows=fp8_rows)
        combine = routing.weights
    else:
        # Typed as varying like the expert weights before the kernel sees them: jax 0.10's
        # ragged_dot otherwise transposes a replicated operand without the psum it needs.
        x = varying_like(x, w_gate)
        local = flat - jax.lax.axis_index("expert").astype(flat.dtype) * e_local
        mine = (local >= 0) & (local < e_local)
        # About 1/expert of the pairs are this device's: the capacity pass is sized for those.
        n = axis_size(step.mesh, "expert")
        out = pair_mlp(x, jnp.where(mine, local, e_local), k, w_gate, w_up, w_down, expected_rows=-(-t * k // n),
                       **extra)  # fmt: skip
        combine, dropped = varying_like(routing.weights, w_gate), none
    out = named("moe_out", out.reshape, t, k, -1)
    out = jnp.einsum("tkd,tk->td", out, combine.astype(out.dtype))
    return psum_varying(out if spread else jax.lax.psum(out, "expert"), ("tensor",)), dropped


def moe_experts(
    x: Float[Array, "T D"],
    routing: Routing,
    w_gate: Float[Array, "E Dw M"],
    w_up: Float[Array, "E Dw M"],
    w_down: Float[Array, "E Mw Dw"],
    *,
    impl: str = "auto",
    dispatch: Dispatch = Dispatch(),
) -> tuple[Float[Array, "T D"], Int[Array, ""]]:
    """The routed experts' combined output through expert path ``impl`` (see
    :func:`resolve_expert_impl`), expert-parallel inside :func:`zoo.parallel.value_and_grad`
    as ``dispatch`` says; and the pairs it dropped (:func:`routed_experts`). In FP8 (the active
    precision map's ``moe_gate``, ``moe_up``, ``moe_down``) on the ``capacity`` path only."""
    resolved = resolve_expert_impl(impl)
    in_fp8 = {name: r for name in MATMULS if (r := fp8.recipe_of(name)) != "none"}
    if in_fp8 and resolved != "capacity":
        raise ConfigError(
            f"the precision map puts the routed experts in FP8 ({', '.join(f'{n}={r}' for n, r in in_fp8.items())}), "
            f"which runs on the 'capacity' expert path only, not on {resolved!r} (expert_impl={impl!r}): set "
            "expert_impl='capacity' or give those matmuls the recipe 'none'"
        )
    path = EXPERT_IMPLS[resolved]
    fp8_rows = resolved == "capacity" and fp8.dispatch_in_fp8()
    return routed_experts(path, x, routing, w_gate, w_up, w_down, pair_mlp=pair_mlp_for(impl), dispatch=dispatch,
                          fp8_rows=fp8_rows)  # fmt: skip
