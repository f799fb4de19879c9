"""Language-model losses.

Training never materialises the float32 logits ``[B, S, V]`` or their gradient:
:func:`chunked_cross_entropy` applies the output head to a chunk of tokens at a time and
computes the chunk's gradient in the same pass (a custom VJP), so the head's FLOPs are those
of the plain loss (forward, and the two gradient products) and its memory is one chunk's
logits. The mean is over every counted prediction of the whole batch, across devices too
(:func:`zoo.hooks.global_sum`), so masks that count differently per row or per device weigh
each prediction alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zoo.core.protocol import CausalLM
from zoo.hooks import vocab as vocab_parallel
from zoo.hooks.pipeline import batch_total
from zoo.hooks.step import (
    context_gather,
    context_positions,
    context_size,
    global_sum,
    sum_to_varying_of,
    varying_like,
    vocab_split,
)


def cross_entropy(
    logits: Float[Array, "B S V"], labels: Int[Array, "B S"], mask: Bool[Array, "B S"] | None = None
) -> Float[Array, ""]:
    """Mean of ``-log softmax(logits)[label]`` over positions where ``mask`` is true (the
    reference the chunked loss is tested against)."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    nll = logz - picked
    if mask is None:
        return jnp.mean(nll)
    m = mask.astype(jnp.float32)
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def next_token_targets(
    input_ids: Int[Array, "B S"],
    segment_ids: Int[Array, "B S"] | None = None,
    loss_mask: Bool[Array, "B S"] | None = None,
    *,
    shift: int = 1,
) -> tuple[Int[Array, "B S1"], Bool[Array, "B S1"] | None]:
    """Labels ``input_ids[:, shift:]`` for positions ``0..S-1-shift``, and which of them count.

    A prediction of token t+shift from position t counts when both lie in the same segment and
    that segment is not 0 (padding), and the target's ``loss_mask`` is set (supervised
    fine-tuning: the assistant's tokens only). ``None``: every prediction counts.
    """
    labels, mask = shifted_targets(input_ids, segment_ids, loss_mask, shift=shift)
    # The last ``shift`` positions have no target: dropped here (shifted_targets masks them).
    return labels[:, :-shift], None if segment_ids is None and loss_mask is None else mask[:, :-shift]


def shifted_targets(
    input_ids: Int[Array, "B S"],
    segment_ids: Int[Array, "B S"] | None = None,
    loss_mask: Bool[Array, "B S"] | None = None,
    *,
    shift: int = 1,
) -> tuple[Int[Array, "B S"], Bool[Array, "B S"]]:
    """:func:`next_token_targets` for every position: position t's target is token t+shift
    (0 where there is none) and the mask says which count. Under context parallelism the
    target may live on another device: the ids (and segments and masks) of the whole sequence
    are gathered (integers, a few bytes a token) and each device reads its own targets."""
    if input_ids.ndim != 2 or input_ids.shape[1] * context_size() < shift + 1:
        raise ValueError(
            f"a next-token loss needs input_ids of [batch, sequence] with at least {shift + 1} positions "
            f"(it predicts token t+{shift} from position t), got shape {tuple(input_ids.shape)}"
        )
    for name, x in (("segment_ids", segment_ids), ("loss_mask", loss_mask)):
        if x is not None and x.shape != input_ids.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, input_ids {tuple(input_ids.shape)}: they must match")
    full = context_gather(input_ids)
    target = context_positions(input_ids.shape[1]) + shift
    valid = target < full.shape[1]
    target = jnp.minimum(target, full.shape[1] - 1)
    labels = jnp.where(valid, jnp.take(full, target, axis=1), 0)
    mask = jnp.broadcast_to(valid, input_ids.shape)
    if segment_ids is not None:
        seg = jnp.take(context_gather(segment_ids), target, axis=1)
        mask = mask & (seg == segment_ids) & (seg != 0)
    if loss_mask is not None:
        mask = mask & jnp.take(context_gather(loss_mask.astype(jnp.bool_)), target, axis=1)
    return labels, mask


def _chunk_tokens(n: int, vocab: int, chunk_tokens: int | None) -> int:
    c = chunk_tokens if chunk_tokens is not None else max(16, vocab_parallel.CHUNK_BYTES // (4 * vocab))
    return max(1, min(c, n))


def _nll_chunks(x, w, labels, weights, chunk: int, with_grads: bool, head_grad: bool = True):
    """Sum of ``weights · nll`` over tokens, a chunk at a time; with ``with_grads`` also its
    gradient with respect to ``x``, with respect to ``w`` where ``head_grad`` (else ``None``:
    a frozen head, LoRA's), and the per-token nll."""
    n, d = x.shape
    pad = -n % chunk
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad))
        weights = jnp.pad(weights, (0, pad))
    xs = x.reshape(-1, chunk, d)
    ls, ws = labels.reshape(-1, chunk), weights.reshape(-1, chunk)

    def body(carry, inputs):
        total, dw = carry
        xc, lc, wc = inputs
        logits = jnp.einsum("cd,vd->cv", xc, w, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        nll = lse - jnp.take_along_axis(logits, lc[:, None], axis=-1)[:, 0]
        total = total + jnp.sum(nll * wc)
        if not with_grads:
            return (total, dw), None
        # d nll / d logits = softmax - onehot(label), weighted per token.
        probs = jnp.exp(logits - lse[:, None])
        dlogits = (probs - jax.nn.one_hot(lc, w.shape[0], dtype=jnp.float32)) * wc[:, None]
        dlogits = dlogits.astype(x.dtype)
        dxc = jnp.einsum("cv,vd->cd", dlogits, w, preferred_element_type=jnp.float32).astype(x.dtype)
        if head_grad:
            dw = dw + jnp.einsum("cv,cd->vd", dlogits, xc, preferred_element_type=jnp.float32)
        return (total, dw), (dxc, nll)

    def zeros(shape):  # a scan carry starts varying over the mesh axes it will vary over
        return varying_like(jnp.zeros(shape, jnp.float32), xs, ws, w)

    carry = (zeros(()), zeros(w.shape) if with_grads and head_grad else None)
    (total, dw), per_chunk = jax.lax.scan(body, carry, (xs, ls, ws))
    if not with_grads:
        return total
    dx, nll = per_chunk
    return total, dx.reshape(-1, d)[:n], None if dw is None else dw.astype(w.dtype), nll.reshape(-1)[:n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _weighted_nll_sum(x, w, labels, weights, chunk):
    return _nll_chunks(x, w, labels, weights, chunk, with_grads=False)


def _weighted_nll_sum_fwd(x, w, labels, weights, chunk):
    # (symbolic zeros: each argument says whether it is differentiated; a frozen head's gradient,
    # a [V, D] float32 sum, is then neither computed nor kept)
    head_grad = w.perturbed
    x, w, labels, weights = x.value, w.value, labels.value, weights.value
    total, dx, dw, nll = _nll_chunks(x, w, labels, weights, chunk, with_grads=True, head_grad=head_grad)
    return total, (dx, dw, nll, w, weights)


def _weighted_nll_sum_bwd(chunk, residuals, g):
    dx, dw, nll, w, weights = residuals
    if isinstance(g, jax.custom_derivatives.SymbolicZero):  # (symbolic zeros: the loss not differentiated)
        g = jnp.zeros(g.aval.shape, g.aval.dtype)
    dx = (g * dx.astype(jnp.float32)).astype(dx.dtype)
    # Inside the parallel step each device holds its tokens' share of the head's gradient;
    # the head itself is replicated over the batch axes, so its cotangent is their sum.
    if dw is not None:
        dw = sum_to_varying_of(g * dw.astype(jnp.float32), w).astype(dw.dtype)
    return dx, dw, None, sum_to_varying_of(g * nll, weights)


_weighted_nll_sum.defvjp(_weighted_nll_sum_fwd, _weighted_nll_sum_bwd, symbolic_zeros=True)


def chunked_cross_entropy(
    x: Float[Array, "B S D"],
    head: Float[Array, "V D"],
    labels: Int[Array, "B S"],
    mask: Bool[Array, "B S"] | None = None,
    *,
    chunk_tokens: int | None = None,
    vocab_size: int | None = None,
) -> Float[Array, ""]:
    """``cross_entropy(unembed(x, head), labels, mask)`` without the ``[B, S, V]`` logits.

    The head applies to ``chunk_tokens`` tokens at a time (default: a chunk's float32 logits
    near 128 MiB); the gradient is computed chunk by chunk in the same pass and only ``x``'s
    and ``head``'s gradients are kept, so memory is linear in the tokens and the FLOPs are
    those of the plain loss. Logits are float32 whatever ``x``'s dtype. Inside the parallel
    step the mean is over the counted predictions of every device.

    ``vocab_size``: the real rows of ``head`` (padding rows after them are never predicted).
    Inside the parallel step with the vocabulary split, ``head`` is this device's block and the
    head is streamed (:func:`zoo.vocab_parallel.weighted_nll_sum`): it is never gathered whole.
    """
    b, s, d = x.shape
    w = head.astype(x.dtype)
    # Typed as varying like the labels (a mask may be built from positions alone): inside the
    # parallel step the count must vary over the batch axes, so that global_sum adds up every
    # device's count.
    weights = varying_like(jnp.ones((b, s), jnp.float32) if mask is None else mask.astype(jnp.float32), labels)
    if (split := vocab_split()) is not None:
        total = vocab_parallel.weighted_nll_sum(x.reshape(b * s, d), w, labels.reshape(-1), weights.reshape(-1), split)
        return global_sum(total) / jnp.maximum(batch_total(jnp.sum(weights)), 1.0)
    if vocab_size is not None and vocab_size < w.shape[0]:
        w = w[:vocab_size]
    chunk = _chunk_tokens(b * s, w.shape[0], chunk_tokens)
    total = _weighted_nll_sum(x.reshape(b * s, d), w, labels.reshape(-1), weights.reshape(-1), chunk)
    return global_sum(total) / jnp.maximum(batch_total(jnp.sum(weights)), 1.0)


def lm_loss(
    model,
    input_ids: Int[Array, "B S"],
    *,
    positions: Int[Array, "B S"] | None = None,
    segment_ids: Int[Array, "B S"] | None = None,
    loss_mask: Bool[Array, "B S"] | None = None,
    placement=None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy: predict token t+1 from position t over every counted
    prediction (:func:`next_token_targets`; without masks all B·(S−1), what ``transformers``
    computes with ``labels=input_ids``). Over packed rows it is the token-weighted mean of each
    document's own loss."""
    labels, mask = shifted_targets(input_ids, segment_ids, loss_mask)
    features = model.forward(input_ids, positions=positions, segment_ids=segment_ids, placement=placement, head=False)[0]
    return chunked_cross_entropy(features, model.unembedding(), labels, mask, vocab_size=model.config.vocab_size)


class NextTokenLM(CausalLM):
    """A family trained on the plain next-token loss alone (no training options): its
    :meth:`loss` is :func:`lm_loss` (``loss_mask``: which targets count), logged as ``lm_loss``."""

    def loss(self, input_ids, *, options=None, positions=None, segment_ids=None, loss_mask=None, placement=None):
        loss = lm_loss(
            self, input_ids, positions=positions, segment_ids=segment_ids, loss_mask=loss_mask, placement=placement
        )
        return loss, {"lm_loss": loss}
