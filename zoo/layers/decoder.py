"""The weights of a pre-norm decoder layer, as the families store them (each stacked over its
layers on a leading ``*L``): a norm, the attention, a norm, then a SwiGLU MLP or the family's
mixture of experts.

A family subclasses :class:`DenseBlock` / :class:`MoEBlock` to name its attention (and experts)
type, which :func:`zoo.core.params.build` reads to assemble the layer. Grouped-query families
share :class:`GQAttention`'s projections.

Dimension letters: D model width · H query heads · G key/value heads · K head size.
"""

from __future__ import annotations

import equinox as eqx
from jaxtyping import Array, Float

from zoo.layers.mlp import SwiGLU


class GQAttention(eqx.Module):
    """Projections of grouped-query attention."""

    wq: Float[Array, "*L D H K"]
    wk: Float[Array, "*L D G K"]
    wv: Float[Array, "*L D G K"]
    wo: Float[Array, "*L H K D"]


class DenseBlock(eqx.Module):
    """Pre-norm attention, then a pre-norm SwiGLU MLP."""

    attn_norm: Float[Array, "*L D"]
    attn: eqx.Module
    mlp_norm: Float[Array, "*L D"]
    mlp: SwiGLU


class MoEBlock(eqx.Module):
    """Pre-norm attention, then a pre-norm mixture of experts."""

    attn_norm: Float[Array, "*L D"]
    attn: eqx.Module
    mlp_norm: Float[Array, "*L D"]
    moe: eqx.Module
