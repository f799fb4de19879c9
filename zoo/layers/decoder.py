"""What every decoder family shares: the hyper-parameters of its config beyond its own
(:class:`DecoderConfig`), and the weights of a pre-norm decoder layer, as the families store
them (each stacked over its layers on a leading ``*L``): a norm, the attention, a norm, then a
SwiGLU MLP or the family's mixture of experts.

A family subclasses :class:`DenseBlock` / :class:`MoEBlock` to name its attention (and experts)
type, which :func:`zoo.core.params.build` reads to assemble the layer. Grouped-query families
share :class:`GQAttention`'s projections.

Dimension letters: V vocabulary · D model width · F dense MLP hidden · H query heads ·
G key/value heads · K head size.
"""

from __future__ import annotations

import abc
from dataclasses import KW_ONLY, dataclass, field

import equinox as eqx
from jaxtyping import Array, Float

from zoo.core.protocol import ModelConfig, check_positive, check_positive_ints
from zoo.errors import ConfigError
from zoo.layers.attention import check_attention
from zoo.layers.mlp import SwiGLU


@dataclass(frozen=True)
class DecoderConfig(ModelConfig):
    """The hyper-parameters every family's config has (Hugging Face's names where they exist).
    A family's frozen dataclass subclasses it with its own sizes and settings; the fields after
    ``num_heads`` here are keyword-only, so a family's own required fields may follow. A family
    also has ``rms_norm_eps``, ``rope`` and ``max_position_embeddings`` (its defaults differ)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    _: KW_ONLY
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Not architecture: which attention path runs (zoo.layers.attention; never in config.json).
    attention: str = "auto"
    # The source config.json's fields this config does not model (pad_token_id, architectures'
    # companions, custom keys), as (name, JSON text) pairs: a save writes them back unchanged.
    hf_extra: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        check_attention(self)
        check_positive(self, "rms_norm_eps", "max_position_embeddings", "initializer_range")
        check_positive_ints(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")

    @property
    def sizes(self) -> dict[str, int]:
        """Size of every dimension letter in the family's legend: these and its :attr:`own_sizes`."""
        return {"V": self.vocab_size, "D": self.hidden_size, "F": self.intermediate_size, **self.own_sizes}

    @property
    @abc.abstractmethod
    def own_sizes(self) -> dict[str, int]:
        """The sizes of the family's own dimension letters (all but V, D and F)."""


@dataclass(frozen=True)
class GQAConfig(DecoderConfig):
    """A grouped-query decoder's: ``num_kv_heads`` key/value heads, each shared by a group of the
    ``num_heads`` query heads, all ``head_dim`` wide (rotated whole)."""

    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        super().__post_init__()
        check_positive_ints(self, "num_kv_heads", "head_dim")
        name = type(self).__name__
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{name}.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{name}.head_dim ({self.head_dim}) must be even for rotary embeddings")


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
