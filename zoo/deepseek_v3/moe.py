"""DeepSeek-V3's mixture of experts: sigmoid routing with the aux-loss-free bias, group-limited
top-k, and the load-balancing rules. The expert compute after routing is shared by every MoE
family (:mod:`zoo.layers.moe`).

Dimension letters: T tokens · D model width · E routed experts · M expert hidden ·
K experts per token (top-k) · G expert groups · X shared experts' hidden · Lm MoE layers.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo.core.named import named
from zoo.hooks.step import context_size, context_sum
from zoo.layers.mlp import SwiGLU
from zoo.layers.moe import (  # noqa: F401  (re-exported: their home before the MoE layer was shared)
    EXPERT_IMPLS,
    ExpertImpl,
    Routing,
    expert_load,
    expert_pair_mlp,
    pair_mlp_for,
    resolve_expert_impl,
    routed_experts_dense,
    routed_experts_grouped,
    routed_experts_ragged,
    routed_experts_tiled,
    sorted_expert_mlp,
)


class MoE(eqx.Module):
    """Router, routed experts (stacked on E) and shared experts of one MoE layer (or all, on ``*L``)."""

    router: Float[Array, "*L D E"]
    router_bias: Float[Array, "*L E"]
    w_gate: Float[Array, "*L E D M"]
    w_up: Float[Array, "*L E D M"]
    w_down: Float[Array, "*L E M D"]
    shared: SwiGLU | None


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
    f32 = jnp.float32
    logits = named("router_logits", lambda: jnp.einsum("td,de->te", x.astype(f32), router.astype(f32)))
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


def sequence_balance_loss(
    scores: Float[Array, "B S E"], experts: Int[Array, "B S K"]
) -> Float[Array, ""]:
    """DeepSeek-V3's sequence-wise balance loss, before its α: per sequence,
    ``Σ_e f_e · P_e`` with ``f_e = E/(K·S) · #tokens choosing e`` and ``P_e`` the mean of the
    scores normalised over experts; averaged over the batch. Under context parallelism a
    sequence's statistics add up over the devices holding its chunks."""
    _, s, e = scores.shape
    k = experts.shape[-1]
    s = s * context_size()
    counts = context_sum(jax.vmap(lambda ex: expert_load(ex, e))(experts))
    f = counts.astype(jnp.float32) * (e / (k * s))
    p = context_sum(jnp.sum(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)) / s
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


def update_router_bias(
    bias: Float[Array, "*L E"], load: Int[Array, "*L E"], gamma: float
) -> Float[Array, "*L E"]:
    """The auxiliary-loss-free balancing step: ``bias_e += γ · sign(mean load − load_e)``
    per layer, so under-loaded experts become likelier to be chosen. Not a gradient step."""
    load = load.astype(jnp.float32)
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return bias + (gamma * step).astype(bias.dtype)
