"""DeepSeek-V3's training objective: next-token loss, weighted MTP loss, sequence-wise balance loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zoo.loss import chunked_cross_entropy, shifted_targets

if TYPE_CHECKING:
    from zoo.deepseek_v3.model import DeepseekV3


@dataclass(frozen=True)
class DeepseekV3Training:
    """Settings of DeepSeek-V3's training objective and of its after-step update."""

    mtp_weight: float = field(default=0.3, metadata={"help": "DeepSeek-V3: MTP loss weight (needs an MTP module)"})
    balance_alpha: float | None = field(
        default=None, metadata={"help": "DeepSeek-V3: sequence-wise balance loss weight (default: config aux_loss_alpha)"}
    )
    router_bias_rate: float = field(default=1e-3, metadata={"help": "DeepSeek-V3: aux-loss-free bias update rate γ"})

    def __post_init__(self):
        for name in ("mtp_weight", "router_bias_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"DeepseekV3Training.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.balance_alpha is not None and not self.balance_alpha >= 0:
            raise ValueError(f"DeepseekV3Training.balance_alpha must be >= 0 or None, got {self.balance_alpha!r}")


class DeepseekV3Metrics(NamedTuple):
    lm_loss: Float[Array, ""]
    mtp_loss: Float[Array, ""]
    balance_loss: Float[Array, ""]
    expert_load: Int[Array, "Lm E"] | None
    dropped_pairs: Int[Array, ""] | None = None


def deepseek_v3_loss(
    model: DeepseekV3,
    input_ids: Int[Array, "B S"],
    *,
    positions: Int[Array, "B S"] | None = None,
    segment_ids: Int[Array, "B S"] | None = None,
    loss_mask: Bool[Array, "B S"] | None = None,
    placement=None,
    mtp_weight: float = 0.3,
    balance_alpha: float | None = None,
) -> tuple[Float[Array, ""], DeepseekV3Metrics]:
    """``lm + mtp_weight · mtp + balance_alpha · balance`` and its parts.

    The MTP term (when the model has MTP) is the cross-entropy of predicting token t+2 from
    position t. ``balance_alpha`` defaults to the config's ``aux_loss_alpha``. The per-layer
    expert load in the metrics feeds :func:`zoo.deepseek_v3.update_router_bias`.
    """
    labels, mask = shifted_targets(input_ids, segment_ids, loss_mask)
    out = model.forward(input_ids, positions=positions, segment_ids=segment_ids, placement=placement, head=False)
    head = model.unembedding()
    vocab = model.config.vocab_size
    lm = chunked_cross_entropy(out.logits, head, labels, mask, vocab_size=vocab)
    mtp = jnp.zeros((), jnp.float32)
    if out.mtp_logits is not None:
        labels2, mask2 = shifted_targets(input_ids, segment_ids, loss_mask, shift=2)
        mtp = chunked_cross_entropy(out.mtp_logits, head, labels2, mask2, vocab_size=vocab)
    alpha = model.config.aux_loss_alpha if balance_alpha is None else balance_alpha
    total = lm + mtp_weight * mtp + alpha * out.balance_loss
    return total, DeepseekV3Metrics(lm, mtp, out.balance_loss, out.expert_load, out.dropped_pairs)
