"""Qwen3-MoE's router: softmax over the experts, top-k, renormalised when ``norm_topk_prob``.

Dimension letters: T tokens · D model width · E routed experts · M expert hidden · K top-k.
The expert compute after routing is shared by every MoE family (:mod:`zoo.layers.moe`).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from zoo.core.named import named
from zoo.layers.moe import Routing


class Qwen3MoE(eqx.Module):
    """Router and routed experts (stacked on E) of one MoE layer (or all, on ``*L``); no shared expert."""

    router: Float[Array, "*L D E"]
    w_gate: Float[Array, "*L E D M"]
    w_up: Float[Array, "*L E D M"]
    w_down: Float[Array, "*L E M D"]


def route(x: Float[Array, "T D"], router: Float[Array, "D E"], *, top_k: int, norm_topk_prob: bool) -> Routing:
    """``softmax(x @ router)`` in float32, the ``top_k`` largest picked; their probabilities are
    the combine weights, divided by their sum when ``norm_topk_prob`` (as ``transformers``)."""
    logits = named("router_logits", lambda: jnp.einsum("td,de->te", x.astype(jnp.float32), router.astype(jnp.float32)))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts, weights, probs)
