"""The vocabulary split over a mesh axis inside the parallel step: the embedding lookup and the
output head's loss streamed a block of rows at a time, so the whole ``[V, D]`` matrix and its
gradient never exist on one device.

Each of the ``F`` devices of the axis holds a contiguous block of ``Vl`` rows (device f: rows
``f·Vl ..``; padding rows last, :func:`zoo.parallel.layout_sizes`). The axis splits the batch
too, so each device needs rows of every block for its own tokens, and Megatron's masked local
lookup with a sum over the axis would not do (it assumes the devices share their tokens). A
loop instead gathers, at step j, rows ``j·c .. j·c+c`` of every device's block (an all-gather of
``c`` rows: ``F·c`` rows in all) and uses them for all of this device's tokens: the lookup takes
the tokens whose ids fall among them; the loss adds their logits into an online log-sum-exp and
picks the targets' logits. The backward pass gathers the same rows again and reduce-scatters
their gradient back into the blocks. A pass moves the matrix's bytes once, as gathering it
whole did, but holds ``F·c`` rows and a ``[tokens, F·c]`` block of float32 logits at a time
(``c`` chosen for :data:`CHUNK_BYTES`). Padding rows never take part: no id points at
them and their logits are masked out, so they get zero gradient.

Pipeline stages share their tokens (:mod:`zoo.pipeline`: every stage sees the same rows), so
over the ``pipeline`` axis the vocabulary is split as Megatron splits it over tensor-parallel
ranks: stage ``p`` holds ids ``p·F·Vl ..`` (split over its ``F`` devices as above), looks up and
scores only those, and the stages combine their parts (the looked-up rows summed; log-sum-exps
merged with a max and a sum; the features' gradient summed). No row crosses the stages' link,
and each stage computes ``1/P`` of the logits.

Dimension letters: N tokens (this device's) · D model width · Vl rows per device · C columns
of a step (``F·c``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from zoo.hooks.step import VocabSplit, sum_to_varying_of, varying_axes, varying_like

# Tokens per chunk: as many as keep one chunk's float32 logits near this many bytes (a 128K
# vocabulary: 256 tokens, 128 MiB). Larger chunks gain nothing measurable on CPU or GPU. The
# loss head (zoo.loss) and its vocabulary-split form here both chunk by it.
CHUNK_BYTES = 128 * 2**20


def _rows_per_step(vl: int, split: VocabSplit, d: int, itemsize: int, tokens: int, budget: int) -> tuple[int, int]:
    """``(c, tc)``: rows per device per step and tokens per chunk, such that the ``F·c`` gathered
    rows, a chunk's float32 feature gradient ``tc x D`` and its float32 logits ``tc x F·c`` each
    stay within ``budget`` bytes where they can."""
    f = split.devices
    tc = max(1, min(tokens, budget // (4 * d)))
    return max(1, min(vl, budget // (f * d * itemsize), budget // (tc * 4 * f))), tc


def _step_rows(j: Array, c: int, vl: int) -> tuple[Array, Bool[Array, " c"]]:
    """Where step ``j``'s ``c`` rows start in a device's block, and which of them are its own:
    the last step starts early so as not to run past the block, and skips rows already done."""
    start = jnp.minimum(j * c, vl - c)
    return start, start + jnp.arange(c) >= j * c


def _gather_rows(block: Float[Array, "c D"], split: VocabSplit) -> Float[Array, "C D"]:
    """Rows of every block of this stage (the devices of ``split.axis``)."""
    return block if split.axis is None else jax.lax.all_gather(block, split.axis, axis=0, tiled=True)


def _scatter_rows(rows: Float[Array, "C D"], split: VocabSplit) -> Float[Array, "c D"]:
    """The transpose of :func:`_gather_rows`: each device's rows, summed over ``split.axis``."""
    return rows if split.axis is None else jax.lax.psum_scatter(rows, split.axis, scatter_dimension=0, tiled=True)


def _stage_start(split: VocabSplit, vl: int) -> Array | int:
    """The first vocabulary id of this device's stage (0 without stages)."""
    return 0 if split.stage_axis is None else jax.lax.axis_index(split.stage_axis) * (split.devices * vl)


def _over_stages(x: Array, split: VocabSplit, reduce=jax.lax.psum) -> Array:
    """``reduce`` of ``x`` over the stages, which share their tokens but each hold a part of the
    vocabulary: every stage gets the whole vocabulary's figure."""
    if split.stage_axis is None:
        return x
    if split.stage_axis not in varying_axes(x):
        x = jax.lax.pcast(x, (split.stage_axis,), to="varying")
    return reduce(x, split.stage_axis)


def _zeros(shape, dtype, *likes) -> Array:
    out = jnp.zeros(shape, dtype)
    for like in likes:
        out = varying_like(out, like)
    return out


# -- the embedding lookup ---------------------------------------------------------------------


def embed(table: Float[Array, "Vl D"], ids: Int[Array, "B S"], dtype, split: VocabSplit) -> Float[Array, "B S D"]:
    """``table_whole[ids]`` cast to ``dtype``, from this device's block ``table`` of a table split
    over ``split.axis``: each step gathers ``c`` rows of every block and takes the ids among them."""
    c = _rows_per_step(table.shape[0], split, table.shape[1], jnp.dtype(dtype).itemsize, 1, CHUNK_BYTES)[0]
    return _embed(table, ids, jnp.dtype(dtype), split, c)


def _where(ids: Int[Array, "*T"], j: Array, c: int, vl: int, split: VocabSplit
           ) -> tuple[Array, Bool[Array, "*T"], Int[Array, "*T"]]:  # fmt: skip
    """Step ``j``'s start, which ``ids`` it serves (those of this stage's part of the vocabulary
    among its rows), and their rows among its gathered rows."""
    start, _ = _step_rows(j, c, vl)
    local = ids - _stage_start(split, vl)
    owner, row = jnp.clip(local // vl, 0, split.devices - 1), local % vl
    hit = (row >= j * c) & (row < start + c) & (local >= 0) & (local < split.devices * vl)
    return start, hit, owner * c + jnp.clip(row - start, 0, c - 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _embed(table, ids, dtype, split, c):
    vl, d = table.shape

    def one(j, out):
        start, hit, pos = _where(ids, j, c, vl, split)
        rows = _gather_rows(jax.lax.dynamic_slice_in_dim(table, start, c).astype(dtype), split)
        return out + jnp.where(hit[..., None], jnp.take(rows, pos, axis=0), jnp.zeros((), dtype))

    out = _zeros((*ids.shape, d), dtype, ids, table)
    # Each stage looked up the ids of its part of the vocabulary (zeros for the others).
    return _over_stages(jax.lax.fori_loop(0, math.ceil(vl / c), one, out), split)


def _embed_fwd(table, ids, dtype, split, c):
    return _embed(table, ids, dtype, split, c), (table, ids)


def _embed_bwd(dtype, split, c, residuals, g):
    table, ids = residuals
    vl, d = table.shape
    flat_g = g.reshape(-1, d).astype(jnp.float32)

    def one(j, grad):
        start, hit, pos = _where(ids.reshape(-1), j, c, vl, split)
        _, fresh = _step_rows(j, c, vl)
        contrib = jnp.where(hit[:, None], flat_g, jnp.float32(0))
        rows = _zeros((split.devices * c, d), jnp.float32, contrib).at[pos].add(contrib)
        block = _scatter_rows(rows, split)
        current = jax.lax.dynamic_slice_in_dim(grad, start, c)
        return jax.lax.dynamic_update_slice_in_dim(grad, current + jnp.where(fresh[:, None], block, 0), start, 0)

    grad = jax.lax.fori_loop(0, math.ceil(vl / c), one, _zeros(table.shape, jnp.float32, table, g))
    return sum_to_varying_of(grad, table).astype(table.dtype), None


_embed.defvjp(_embed_fwd, _embed_bwd)


def gather(table: Float[Array, "Vl D"], split: VocabSplit) -> Float[Array, "V D"]:
    """The whole matrix from its blocks (a model call inside the step, outside the loss: its
    logits need every row at once)."""
    rows = _gather_rows(table, split)  # this stage's part
    if split.stage_axis is None:
        return rows
    # Over the stages a sum of the parts each in its place, not an all-gather: the whole matrix
    # is then typed the same on every stage, as what is computed from it must be (its gradient
    # reaches each stage's part whole, not summed over stages that computed the same logits).
    placed = jax.lax.dynamic_update_index_in_dim(
        _zeros((split.stages, *rows.shape), rows.dtype, rows), rows, jax.lax.axis_index(split.stage_axis), 0
    )
    return jax.lax.psum(placed, split.stage_axis).reshape(-1, rows.shape[-1])


# -- the loss head --------------------------------------------------------------------------------


def weighted_nll_sum(x: Float[Array, "N D"], w: Float[Array, "Vl D"], labels: Int[Array, " N"],
                     weights: Float[Array, " N"], split: VocabSplit) -> Float[Array, ""]:  # fmt: skip
    """``sum(weights · (logsumexp(x @ w_whole.T) - (x @ w_whole.T)[label]))`` over the real
    vocabulary, from this device's block ``w`` of a head split over ``split.axis``."""
    c, tc = _rows_per_step(w.shape[0], split, w.shape[1], w.dtype.itemsize, x.shape[0], CHUNK_BYTES)
    return _nll_sum(x, w, labels, weights, split, c, tc)


def _columns(j: Array, c: int, vl: int, split: VocabSplit) -> tuple[Array, Int[Array, " C"], Bool[Array, " C"]]:
    """Step ``j``'s start, the vocabulary id of each gathered row, and which rows count (this
    step's own, and real: padding rows never do)."""
    start, fresh = _step_rows(j, c, vl)
    owner = np.repeat(np.arange(split.devices), c)
    ids = _stage_start(split, vl) + owner * vl + start + jnp.tile(jnp.arange(c), split.devices)
    return start, ids, jnp.tile(fresh, split.devices) & (ids < split.vocab_size)


def _token_chunk(k: Array, tc: int, n: int) -> tuple[Array, Bool[Array, " tc"]]:
    """Where token chunk ``k`` starts and which of its tokens are its own (as :func:`_step_rows`:
    the last chunk starts early rather than padding the features, and skips tokens done)."""
    start = jnp.minimum(k * tc, n - tc)
    return start, start + jnp.arange(tc) >= k * tc


def _logits(xc, w, j, c, vl, split):
    start, ids, valid = _columns(j, c, vl, split)
    rows = _gather_rows(jax.lax.dynamic_slice_in_dim(w, start, c), split)
    logits = jnp.einsum("td,cd->tc", xc, rows, preferred_element_type=jnp.float32)
    return start, rows, ids, valid, jnp.where(valid[None, :], logits, -jnp.inf)


def _lse_and_target(x, w, labels, split, c, tc):
    (n, _), vl = x.shape, w.shape[0]

    def chunk(k, out):
        start, _ = _token_chunk(k, tc, n)
        xc, lc = jax.lax.dynamic_slice_in_dim(x, start, tc), jax.lax.dynamic_slice_in_dim(labels, start, tc)

        def one(j, carry):
            m, s, t = carry
            _, _, ids, valid, logits = _logits(xc, w, j, c, vl, split)
            m_new = jnp.maximum(m, jnp.max(logits, axis=1))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0)
            s = s * jnp.exp(m - safe) + jnp.sum(jnp.exp(logits - safe[:, None]), axis=1)
            t = t + jnp.sum(jnp.where(valid[None, :] & (ids[None, :] == lc[:, None]), logits, 0), axis=1)
            return m_new, s, t

        zeros = _zeros((tc,), jnp.float32, xc, w)
        m, s, t = jax.lax.fori_loop(0, math.ceil(vl / c), one, (zeros - jnp.inf, zeros, zeros))
        # A token in two chunks (the last starts early) gets the same figures twice: one write.
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, v, start, 0) for o, v in zip(out, (m + jnp.log(s), t)))

    zeros = _zeros((n,), jnp.float32, x, w)
    lse, target = jax.lax.fori_loop(0, math.ceil(n / tc), chunk, (zeros, zeros))
    if split.stage_axis is None:
        return lse, target
    # Each stage has the log-sum-exp of its part of the vocabulary (-inf for a part of padding
    # rows only) and the target's logit where it holds the target (0 elsewhere): combined.
    top = jax.lax.stop_gradient(_over_stages(lse, split, jax.lax.pmax))
    lse = top + jnp.log(_over_stages(jnp.exp(lse - top), split))
    return lse, _over_stages(target, split)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _nll_sum(x, w, labels, weights, split, c, tc):
    lse, target = _lse_and_target(x, w, labels, split, c, tc)
    return jnp.sum((lse - target) * weights)


def _nll_sum_fwd(x, w, labels, weights, split, c, tc):
    lse, target = _lse_and_target(x, w, labels, split, c, tc)
    nll = lse - target
    return jnp.sum(nll * weights), (x, w, labels, weights, lse, nll)


def _nll_sum_bwd(split, c, tc, residuals, g):
    x, w, labels, weights, lse, nll = residuals
    (n, d), vl = x.shape, w.shape[0]
    scales = weights * g

    def chunk(k, carry):
        dx, dw = carry
        start, own = _token_chunk(k, tc, n)
        xc, lc, lsec, sc = (jax.lax.dynamic_slice_in_dim(a, start, tc) for a in (x, labels, lse, scales))
        sc = jnp.where(own, sc, 0)  # a token done in the chunk before adds nothing to the head's gradient

        def one(j, carry):
            dxc, dw = carry
            start, rows, ids, valid, logits = _logits(xc, w, j, c, vl, split)
            _, fresh = _step_rows(j, c, vl)
            # d nll / d logits = softmax - onehot(label), weighted per token (0 on masked rows).
            target = valid[None, :] & (ids[None, :] == lc[:, None])
            dlogits = ((jnp.exp(logits - lsec[:, None]) - target.astype(jnp.float32)) * sc[:, None]).astype(x.dtype)
            dxc = dxc + jnp.einsum("tc,cd->td", dlogits, rows, preferred_element_type=jnp.float32)
            drows = jnp.einsum("tc,td->cd", dlogits, xc, preferred_element_type=jnp.float32)
            block = _scatter_rows(drows, split)
            current = jax.lax.dynamic_slice_in_dim(dw, start, c)
            return dxc, jax.lax.dynamic_update_slice_in_dim(dw, current + jnp.where(fresh[:, None], block, 0), start, 0)

        dxc, dw = jax.lax.fori_loop(0, math.ceil(vl / c), one, (_zeros((tc, d), jnp.float32, xc, w, sc), dw))
        current = jax.lax.dynamic_slice_in_dim(dx, start, tc)
        dxc = jnp.where(own[:, None], dxc.astype(x.dtype), current)
        return jax.lax.dynamic_update_slice_in_dim(dx, dxc, start, 0), dw

    dx0 = _zeros((n, d), x.dtype, x, w, scales)
    dx, dw = jax.lax.fori_loop(0, math.ceil(n / tc), chunk, (dx0, _zeros(w.shape, jnp.float32, w, x, scales)))
    dx = _over_stages(dx, split)  # each stage's columns add their part of the features' gradient
    return sum_to_varying_of(dx, x), sum_to_varying_of(dw, w).astype(w.dtype), None, sum_to_varying_of(g * nll, weights)


_nll_sum.defvjp(_nll_sum_fwd, _nll_sum_bwd)
