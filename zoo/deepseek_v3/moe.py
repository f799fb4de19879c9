"""DeepSeek-V3 mixture of experts: sigmoid routing with the aux-loss-free bias, group-limited
top-k, dropless expert compute with ``jax.lax.ragged_dot``, and the load-balancing rules.

Dimension letters: T tokens · D model width · E routed experts · M expert hidden ·
K experts per token (top-k) · G expert groups · X shared experts' hidden · Lm MoE layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from zoo.layers.grouped_matmul import grouped_matmul, tile_layout
from zoo.layers.mlp import SwiGLU

ExpertImpl = Literal["auto", "ragged_dot", "grouped", "tiled", "dense"]


class MoE(eqx.Module):
    """Router, routed experts (stacked on E) and shared experts of one MoE layer (or all, on ``*L``)."""

    router: Float[Array, "*L D E"]
    router_bias: Float[Array, "*L E"]
    w_gate: Float[Array, "*L E D M"]
    w_up: Float[Array, "*L E D M"]
    w_down: Float[Array, "*L E M D"]
    shared: SwiGLU | None


class Routing(NamedTuple):
    """Which experts each token goes to, with what weight; and the scores behind it."""

    experts: Int[Array, "T K"]
    weights: Float[Array, "T K"]
    scores: Float[Array, "T E"]


def route(
    x: Float[Array, "T D"],
    router: Float[Array, "D E"],
    bias: Float[Array, " E"],
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> Routing:
    """DeepSeek-V3's router, in float32.

    Scores are ``sigmoid(x @ router)``. The correction ``bias`` only *chooses*: each group is
    scored by the sum of its two best biased scores, the ``topk_group`` best groups are kept,
    and the ``top_k`` best biased scores among them are picked. The combine weights are the
    *unbiased* scores of the picked experts, normalised to sum 1 when ``norm_topk_prob``, times
    ``scaling``. No gradient reaches the bias (it is updated by :func:`update_router_bias`).
    """
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), router.astype(jnp.float32))
    logits = checkpoint_name(logits, "router_logits")
    scores = jax.nn.sigmoid(logits)
    choice = jax.lax.stop_gradient(scores) + jax.lax.stop_gradient(bias).astype(jnp.float32)
    n_experts = choice.shape[-1]
    if n_group > 1:
        grouped = choice.reshape(-1, n_group, n_experts // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, keep = jax.lax.top_k(group_scores, topk_group)
        group_mask = jnp.zeros_like(group_scores, dtype=jnp.bool_).at[jnp.arange(keep.shape[0])[:, None], keep].set(True)
        expert_mask = jnp.repeat(group_mask, n_experts // n_group, axis=-1)
        choice = jnp.where(expert_mask, choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return Routing(experts, weights * scaling, scores)


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
    gate = checkpoint_name(matmul(rows, w_gate, group_sizes), "moe_gate")
    up = checkpoint_name(matmul(rows, w_up, group_sizes), "moe_up")
    hidden = checkpoint_name(jax.nn.silu(gate) * up, "moe_hidden")
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
) -> Float[Array, "P D"]:
    """The output of every (token ``p // k``, expert ``pair_experts[p]``) pair, in pair order.

    The pairs are sorted by expert, run through :func:`sorted_expert_mlp` and unsorted (a
    gather, not a scatter-add). An expert id of ``E`` marks a pair that is not this call's
    (expert parallelism: another device's expert): it sorts last, is skipped, and gives zeros.
    """
    e = w_gate.shape[0]
    order = jnp.argsort(pair_experts, stable=True)
    sizes = jnp.bincount(pair_experts, length=e + 1)[:e]
    out = sorted_expert_mlp(jnp.take(x, order // k, axis=0), sizes, w_gate, w_up, w_down, matmul)
    return jnp.take(out, jnp.argsort(order), axis=0)


def _routed_experts_sorted(matmul, x, routing, w_gate, w_up, w_down):
    """:func:`expert_pair_mlp` on the T·K routed pairs, then each token's K outputs combined."""
    t, k = routing.experts.shape
    out = expert_pair_mlp(x, routing.experts.reshape(-1), k, w_gate, w_up, w_down, matmul=matmul)
    out = checkpoint_name(out.reshape(t, k, -1), "moe_out")
    return jnp.einsum("tkd,tk->td", out, routing.weights.astype(out.dtype))


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
    xt = jnp.where(valid[..., None], jnp.take(x, tokens, axis=0), jnp.zeros((), x.dtype))
    gate = checkpoint_name(jnp.einsum("ntd,ndm->ntm", xt, jnp.take(w_gate, owner, axis=0)), "moe_gate")
    up = checkpoint_name(jnp.einsum("ntd,ndm->ntm", xt, jnp.take(w_up, owner, axis=0)), "moe_up")
    hidden = checkpoint_name(jax.nn.silu(gate) * up, "moe_hidden")
    out = jnp.einsum("ntm,nmd->ntd", hidden, jnp.take(w_down, owner, axis=0)).reshape(n_tiles * tile, -1)
    # Where each (token, k) pair landed: its rank in the sort gives its expert's tile and slot.
    within = jnp.argsort(order) - tiles.group_first_row[flat]
    slot = (tiles.group_first_tile[flat] + within // tile) * tile + within % tile
    # The combine weights' gradient needs each expert's output: naming it spares the down projection.
    out = checkpoint_name(jnp.take(out, slot, axis=0).reshape(t, k, -1), "moe_out")
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
    gate = checkpoint_name(jnp.einsum("td,edm->tem", x, w_gate), "moe_gate")
    up = checkpoint_name(jnp.einsum("td,edm->tem", x, w_up), "moe_up")
    hidden = checkpoint_name(jax.nn.silu(gate) * up, "moe_hidden")
    return jnp.einsum("tem,emd,te->td", hidden, w_down, combine)


EXPERT_IMPLS = {
    "ragged_dot": routed_experts_ragged,
    "grouped": routed_experts_grouped,
    "tiled": routed_experts_tiled,
    "dense": routed_experts_dense,
}


def pair_mlp_for(impl: str) -> Callable[..., Float[Array, "P D"]]:
    """:func:`expert_pair_mlp` with the grouped matmul of expert path ``impl``: XLA's
    ``ragged_dot`` for ``"ragged_dot"``, zoo's :func:`grouped_matmul` for the others (expert
    parallelism runs every path's experts on sorted rows)."""
    matmul = jax.lax.ragged_dot if resolve_expert_impl(impl) == "ragged_dot" else grouped_matmul
    return functools.partial(expert_pair_mlp, matmul=matmul)


def resolve_expert_impl(impl: str) -> str:
    """``auto``: ``ragged_dot`` where XLA has a grouped-matmul lowering for it (TPU), else
    ``grouped`` (1.4-1.5x faster than ``tiled`` on CPU: benchmarks/moe.py)."""
    if impl == "auto":
        return "ragged_dot" if jax.default_backend() == "tpu" else "grouped"
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"expert_impl must be one of {['auto', *EXPERT_IMPLS]}, got {impl!r}")
    return impl


def sequence_balance_loss(
    scores: Float[Array, "B S E"], experts: Int[Array, "B S K"]
) -> Float[Array, ""]:
    """DeepSeek-V3's sequence-wise balance loss, before its α: per sequence,
    ``Σ_e f_e · P_e`` with ``f_e = E/(K·S) · #tokens choosing e`` and ``P_e`` the mean of the
    scores normalised over experts; averaged over the batch."""
    _, s, e = scores.shape
    k = experts.shape[-1]
    counts = jax.vmap(lambda ex: expert_load(ex, e))(experts)
    f = counts.astype(jnp.float32) * (e / (k * s))
    p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


def update_router_bias(
    bias: Float[Array, "*L E"], load: Int[Array, "*L E"], gamma: float
) -> Float[Array, "*L E"]:
    """The auxiliary-loss-free balancing step: ``bias_e += γ · sign(mean load − load_e)``
    per layer, so under-loaded experts become likelier to be chosen. Not a gradient step."""
    load = load.astype(jnp.float32)
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return bias + (gamma * step).astype(bias.dtype)
