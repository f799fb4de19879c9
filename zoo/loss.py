"""Language-model losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def cross_entropy(
    logits: Float[Array, "B S V"], labels: Int[Array, "B S"], mask: Bool[Array, "B S"] | None = None
) -> Float[Array, ""]:
    """Mean of ``-log softmax(logits)[label]`` over positions where ``mask`` is true."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    nll = logz - picked
    if mask is None:
        return jnp.mean(nll)
    m = mask.astype(jnp.float32)
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def next_token_targets(
    input_ids: Int[Array, "B S"], segment_ids: Int[Array, "B S"] | None = None
) -> tuple[Int[Array, "B S1"], Bool[Array, "B S1"] | None]:
    """Labels ``input_ids[:, 1:]`` for positions ``0..S-2``; with packed segments, the mask
    drops predictions across a segment boundary."""
    if input_ids.ndim != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"a next-token loss needs input_ids of [batch, sequence] with at least 2 positions "
            f"(it predicts token t+1 from position t), got shape {tuple(input_ids.shape)}"
        )
    labels = input_ids[:, 1:]
    if segment_ids is None:
        return labels, None
    return labels, segment_ids[:, 1:] == segment_ids[:, :-1]


def lm_loss(
    model,
    input_ids: Int[Array, "B S"],
    *,
    positions: Int[Array, "B S"] | None = None,
    segment_ids: Int[Array, "B S"] | None = None,
    placement=None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy: predict token t+1 from position t over B·(S−1) terms
    (what ``transformers`` computes with ``labels=input_ids``)."""
    labels, mask = next_token_targets(input_ids, segment_ids)
    logits = model(input_ids, positions=positions, segment_ids=segment_ids, placement=placement)
    return cross_entropy(logits[:, :-1], labels, mask)
