"""Qwen3-MoE's training objective beyond the next-token loss: the Switch-style load-balancing loss.

``transformers`` (``load_balancing_loss_func``) concatenates every MoE layer's router
probabilities and computes ``E · Σ_e f_e · P_e`` once over all of them: ``f_e`` the fraction of
(token, choice) pairs routed to expert ``e`` per token, ``P_e`` the mean router probability of
``e``. Both are means over the tokens of all MoE layers, so each layer contributes its sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo.hooks.pipeline import stack_total
from zoo.hooks.step import global_sum
from zoo.layers.moe import Routing, expert_load


@dataclass(frozen=True)
class Qwen3Training:
    """Settings of Qwen3-MoE's training objective (none apply to dense Qwen3)."""

    aux_loss_coef: float | None = field(
        default=None, metadata={"help": "Qwen3-MoE: load-balancing loss weight (default: config router_aux_loss_coef)"}
    )

    def __post_init__(self):
        if self.aux_loss_coef is not None and not self.aux_loss_coef >= 0:
            raise ValueError(f"Qwen3Training.aux_loss_coef must be >= 0 or None, got {self.aux_loss_coef!r}")


class RouterStats(NamedTuple):
    """What the balance loss needs of the routers: per MoE layer, the (token, choice) pairs per
    expert; over all MoE layers, the sum of the router probabilities per expert and the pairs
    the dispatch dropped."""

    load: Int[Array, "Lm E"]
    prob_sum: Float[Array, " E"]
    dropped_pairs: Int[Array, ""] | None = None  # past the dispatch's capacity (zoo.layers.moe_dispatch)


def layer_router_stats(routing: Routing, n_experts: int) -> tuple[Int[Array, " E"], Float[Array, " E"]]:
    """One layer's expert load and the sum of its router probabilities over its tokens."""
    return expert_load(routing.experts, n_experts), jnp.sum(routing.scores, axis=0)


def switch_balance_loss(stats: RouterStats, top_k: int) -> Float[Array, ""]:
    """``E · Σ_e f_e · P_e`` over the tokens of every MoE layer (before its coefficient).

    Inside the parallel step the statistics are summed over the whole batch first
    (:func:`zoo.hooks.global_sum`): the loss is a product of means, so it is the one-device
    loss only when computed from the global counts. The loads (constants: no gradient) are the
    whole batch's (:func:`zoo.hooks.pipeline.stack_total`) and the loss is linear in the
    probabilities given them, so on the 1F1B schedule a micro-batch's share, from its own
    probabilities, adds up to the batch's loss and gradient."""
    load = stack_total(stats.load).astype(jnp.float32)
    prob_sum = global_sum(stats.prob_sum)
    e = load.shape[-1]
    total = jnp.sum(load) / top_k  # tokens, over all MoE layers
    f = jax.lax.stop_gradient(jnp.sum(load, axis=0)) / total
    return e * jnp.sum(f * prob_sum / total)
