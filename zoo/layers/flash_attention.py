"""Blockwise (flash) causal attention in pure JAX: memory linear in the sequence length, about
half the dense product's work under the causal mask, and a hand-written FlashAttention-2 backward.

Semantics are those of :func:`zoo.layers.attention.causal_attention` (causal, optional packed
``segment_ids``, GQA with query head h reading key/value head h // R, value head size Kv free).

Forward: a ``lax.scan`` over query blocks; for each, a ``lax.fori_loop`` over only the key/value
blocks the causal mask leaves visible (a trip count that depends on the block index), keeping a
float32 running max, sum and accumulator (online softmax). With ``segment_ids`` a block pair whose
segment-id ranges [min, max] do not intersect is skipped by ``lax.cond``: safe for any pattern
(disjoint ranges share no id), exact for packed rows numbered in order (under ``vmap`` over the
segment ids the cond turns into a select: still right, nothing skipped). The loop trip
count is data dependent, which autodiff cannot transpose, so the gradient is written out
(``jax.custom_vjp``): the backward re-walks the same pairs, recomputing each block's
probabilities from the saved per-row log-sum-exp, and accumulates dq, dk, dv in float32.

Internally operands are heads-major blocks ``[n, B, G, R·blk, D]``: a query block stacks the R
query heads of a key/value head along its rows (row = r·blk + position), so every block product
is a 2-D matmul batched over (B, G) and keys/values are never repeated (as in attention.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from zoo.hooks.step import varying_axes, varying_over

# Fastest forward + backward on the 2-core CPU (B=1, H=G=8, K=64, float32, S 512..4096; 128,
# 512, 1024 and mixed 256/512 blocks measured too). Accelerators likely want larger blocks.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_KV = 256


def _vma(*xs) -> tuple[str, ...]:
    """The ``shard_map`` mesh axes any of ``xs`` varies over (none outside ``shard_map``)."""
    return tuple(sorted(frozenset().union(*(varying_axes(x) for x in xs if x is not None))))


def _full(shape, value, dtype, axes: tuple[str, ...]) -> Array:
    """A constant loop carry typed as varying over ``axes``: inside ``shard_map`` a carry must
    start with the type it ends with."""
    return varying_over(jnp.full(shape, value, dtype), axes)


def _sum_to_vma_of(x, like) -> Array:
    """``x`` summed over the axes it varies over and ``like`` does not (a cotangent must have
    its primal's type; an operand replicated over an axis the others split gets its sum)."""
    axes = tuple(a for a in _vma(x) if a not in _vma(like))
    return jax.lax.psum(x, axes) if axes else x


def _blocks(x, groups: int, blk: int, pad_value=0) -> Array:
    """``[B, S, H, D]`` (H = groups·R) padded to whole blocks -> ``[n, B, G, R·blk, D]``."""
    b, s, h, d = x.shape
    n = -(-s // blk)
    x = jnp.pad(x, ((0, 0), (0, n * blk - s), (0, 0), (0, 0)), constant_values=pad_value)
    x = x.reshape(b, n, blk, groups, h // groups, d).transpose(1, 0, 3, 4, 2, 5)
    return x.reshape(n, b, groups, h // groups * blk, d)


def _unblocks(x, s: int, r: int) -> Array:
    """Inverse of :func:`_blocks`, padding rows dropped: ``[n, B, G, R·blk, D]`` -> ``[B, S, H, D]``."""
    n, b, g, rows, d = x.shape
    x = x.reshape(n, b, g, r, rows // r, d).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(b, n * (rows // r), g * r, d)[:, :s]


def _row_blocks(x, groups: int, blk: int, pad_value) -> Array:
    """Per-row statistics ``[B, H, S]`` -> ``[n, B, G, R·blk]``."""
    return _blocks(x.transpose(0, 2, 1)[..., None], groups, blk, pad_value)[..., 0]


class _Plan:
    """Which (query block, key/value block) pairs to visit, and each pair's mask."""

    def __init__(self, s: int, t: int, r: int, block_q: int, block_kv: int, segment_ids, kv_segment_ids, q_offset):
        """``s`` queries at places ``q_offset ..`` of ``t`` keys (``q_offset`` may be traced)."""
        self.bq, self.bkv, self.r = min(block_q, s), min(block_kv, t), r
        self.nq, self.nk = -(-s // self.bq), -(-t // self.bkv)
        self.s, self.q_offset = s, q_offset
        self.seg_q = self.seg_k = self.visit = None
        if segment_ids is not None:
            kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
            # Edge padding: padded rows/keys never widen a block's id range.
            seg = jnp.pad(segment_ids, ((0, 0), (0, self.nq * self.bq - s)), mode="edge")
            kseg = jnp.pad(kv_seg, ((0, 0), (0, self.nk * self.bkv - t)), mode="edge")
            sq = seg.reshape(-1, self.nq, self.bq).transpose(1, 0, 2)  # [nq, B, bq]
            sk = kseg.reshape(-1, self.nk, self.bkv).transpose(1, 0, 2)  # [nk, B, bkv]
            self.seg_q, self.seg_k = jnp.tile(sq, (1, 1, r)), sk
            lo_q, hi_q, lo_k, hi_k = sq.min(-1), sq.max(-1), sk.min(-1), sk.max(-1)
            meet = (lo_q[:, None] <= hi_k[None, :]) & (lo_k[None, :] <= hi_q[:, None])  # [nq, nk, B]
            self.visit = meet.any(-1)

    def kv_loop(self, i, body, carry):
        """``carry = body(j, carry)`` over the key/value blocks query block ``i`` must see."""
        # Causal: the blocks up to the one holding the key of query block i's last real row.
        hi = (self.q_offset + jnp.minimum((i + 1) * self.bq, self.s) + self.bkv - 1) // self.bkv
        if self.visit is None:
            return jax.lax.fori_loop(0, hi, body, carry)

        def step(j, c):
            return jax.lax.cond(self.visit[i, j], body, lambda _, c: c, j, c)

        return jax.lax.fori_loop(0, hi, step, carry)

    def mask(self, i, j, keys_first: bool = False) -> Array:
        """Allowed (query row, key) pairs of block pair (i, j): ``[R·bq, bkv]`` or, with segment
        ids, ``[B, 1, R·bq, bkv]``; the last two axes swapped if ``keys_first``."""
        q_pos = self.q_offset + i * self.bq + jnp.arange(self.r * self.bq, dtype=jnp.int32) % self.bq
        k_pos = j * self.bkv + jnp.arange(self.bkv, dtype=jnp.int32)
        q_axis, k_axis = (-1, -2) if keys_first else (-2, -1)
        allowed = jnp.expand_dims(q_pos, k_axis) >= jnp.expand_dims(k_pos, q_axis)
        if self.seg_q is None:
            return allowed
        sq = jnp.expand_dims(jax.lax.dynamic_index_in_dim(self.seg_q, i, keepdims=False), k_axis)
        sk = jnp.expand_dims(jax.lax.dynamic_index_in_dim(self.seg_k, j, keepdims=False), q_axis)
        return (allowed & (sq == sk))[:, None]


def _matmul(a, b) -> Array:
    """``a @ b`` over the last two axes, batched over (B, G), float32. Every product below is
    arranged to contract ``a``'s last axis: XLA:CPU runs a transposed ``a`` about 3x slower."""
    return jnp.einsum("bgxc,bgcy->bgxy", a, b, preferred_element_type=jnp.float32)


def _t(x) -> Array:
    return x.swapaxes(-1, -2)


def _forward(q, k, v, segment_ids, kv_segment_ids, q_offset, scale: float, block_q: int, block_kv: int):
    """Output ``[B, S, H, Kv]``, float32 lse ``[B, H, S]`` and the number of block pairs visited."""
    b, s, h = q.shape[:3]
    g, kv = k.shape[2], v.shape[-1]
    plan = _Plan(s, k.shape[1], h // g, block_q, block_kv, segment_ids, kv_segment_ids, q_offset)
    kt, vb = _t(_blocks(k, g, plan.bkv)), _blocks(v, g, plan.bkv)
    axes = _vma(q, k, v, segment_ids, kv_segment_ids, q_offset)
    rows = (b, g, plan.r * plan.bq)

    def q_step(count, xs):
        i, qi = xs

        def kv_step(j, carry):
            m, l, acc, count = carry
            ktj = jax.lax.dynamic_index_in_dim(kt, j, keepdims=False)
            vj = jax.lax.dynamic_index_in_dim(vb, j, keepdims=False)
            sc = jnp.where(plan.mask(i, j), _matmul(qi, ktj) * scale, -jnp.inf)  # [B, G, R·bq, bkv]
            m_new = jnp.maximum(m, sc.max(-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row masked so far: no inf - inf
            p = jnp.exp(sc - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = _matmul(p.astype(v.dtype), vj)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv, count + 1

        init = (_full(rows, -jnp.inf, jnp.float32, axes), _full(rows, 0.0, jnp.float32, axes),
                _full((*rows, kv), 0.0, jnp.float32, axes), count)
        m, l, acc, count = plan.kv_loop(i, kv_step, init)
        # A row with no visible key (impossible under causal masking) gives 0 and lse -inf.
        l_safe = jnp.where(l == 0.0, 1.0, l)
        lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))
        return count, ((acc / l_safe[..., None]).astype(v.dtype), lse)

    count, (out, lse) = jax.lax.scan(q_step, jnp.int32(0), (jnp.arange(plan.nq, dtype=jnp.int32), _blocks(q, g, plan.bq)))
    lse = _unblocks(lse[..., None], s, plan.r)[..., 0].transpose(0, 2, 1)
    return _unblocks(out, s, plan.r), lse, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _flash(q, k, v, segment_ids, kv_segment_ids, q_offset, scale, block_q, block_kv, residual_names):
    return _forward(q, k, v, segment_ids, kv_segment_ids, q_offset, scale, block_q, block_kv)[:2]


def _flash_fwd(q, k, v, segment_ids, kv_segment_ids, q_offset, scale, block_q, block_kv, residual_names):
    out, lse, _ = _forward(q, k, v, segment_ids, kv_segment_ids, q_offset, scale, block_q, block_kv)
    if residual_names is not None:
        # Named here, where jax.checkpoint's policy sees the residuals, and returned as the same
        # values: a name given outside would mark only the outputs (the forward would re-run to
        # rebuild the residuals) or, with both, save the output twice.
        out, lse = checkpoint_name(out, residual_names[0]), checkpoint_name(lse, residual_names[1])
    return (out, lse), (q, k, v, segment_ids, kv_segment_ids, q_offset, out, lse)


def _flash_bwd(scale, block_q, block_kv, residual_names, residuals, cotangents):
    """FlashAttention-2's backward: P = exp(S - lse), dS = P ∘ (dP - D) with D = rowsum(dO ∘ O)
    (less d lse, whose gradient is P itself), walking the forward's block pairs again. Blocks are
    computed transposed (keys along the rows), so dk and dv are plain products (:func:`_matmul`)."""
    q, k, v, segment_ids, kv_segment_ids, q_offset, out, lse = residuals
    dout, dlse = cotangents
    s, h, g = q.shape[1], q.shape[2], k.shape[2]
    t = k.shape[1]
    plan = _Plan(s, t, h // g, block_q, block_kv, segment_ids, kv_segment_ids, q_offset)
    delta = jnp.einsum("bshv,bshv->bhs", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse
    # +inf for padded rows and rows that saw no key: their P is exactly 0 (never exp(inf - inf)).
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    qb, dob = _blocks(q, g, plan.bq), _blocks(dout, g, plan.bq)
    kb, vb = _blocks(k, g, plan.bkv), _blocks(v, g, plan.bkv)
    kt = _t(kb)
    axes = _vma(q, k, v, segment_ids, kv_segment_ids, q_offset, dout, dlse)

    def q_step(carry, xs):
        i, qi, doi, lse_i, delta_i = xs
        qti, doti = _t(qi), _t(doi)

        def kv_step(j, carry):
            dqt, dk, dv = carry
            kj, ktj, vj = (jax.lax.dynamic_index_in_dim(x, j, keepdims=False) for x in (kb, kt, vb))
            st = jnp.where(plan.mask(i, j, keys_first=True), _matmul(kj, qti) * scale, -jnp.inf)
            pt = jnp.exp(st - lse_i[..., None, :])  # [B, G, bkv, R·bq]
            dst = pt * (_matmul(vj, doti) - delta_i[..., None, :])  # dScores / scale (applied at the end)
            dqt = dqt + _matmul(ktj, dst.astype(k.dtype))
            dk_j, dv_j = _matmul(dst.astype(q.dtype), qi), _matmul(pt.astype(dout.dtype), doi)
            dk = jax.lax.dynamic_update_index_in_dim(dk, jax.lax.dynamic_index_in_dim(dk, j) + dk_j[None], j, 0)
            dv = jax.lax.dynamic_update_index_in_dim(dv, jax.lax.dynamic_index_in_dim(dv, j) + dv_j[None], j, 0)
            return dqt, dk, dv

        dqt, dk, dv = plan.kv_loop(i, kv_step, (_full(qti.shape, 0.0, jnp.float32, axes), *carry))
        return (dk, dv), _t(dqt)

    init = (_full(kb.shape, 0.0, jnp.float32, axes), _full(vb.shape, 0.0, jnp.float32, axes))
    xs = (jnp.arange(plan.nq, dtype=jnp.int32), qb, dob,
          _row_blocks(lse, g, plan.bq, jnp.inf), _row_blocks(delta, g, plan.bq, 0.0))
    (dk, dv), dq = jax.lax.scan(q_step, init, xs)
    dq = (_unblocks(dq, s, plan.r) * scale).astype(q.dtype)
    dk = (_unblocks(dk, t, 1) * scale).astype(k.dtype)
    dv = _unblocks(dv, t, 1).astype(v.dtype)
    return _sum_to_vma_of(dq, q), _sum_to_vma_of(dk, k), _sum_to_vma_of(dv, v), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention_with_lse(
    q: Float[Array, "B S H K"],
    k: Float[Array, "B T G K"],
    v: Float[Array, "B T G Kv"],
    *,
    scale: float,
    segment_ids: Int[Array, "B S"] | None = None,
    kv_segment_ids: Int[Array, "B T"] | None = None,
    q_offset: int | Int[Array, ""] = 0,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    residual_names: tuple[str, str] | None = None,
) -> tuple[Float[Array, "B S H Kv"], Float[Array, "B H S"]]:
    """:func:`blockwise_attention` and the float32 log-sum-exp of each row's scaled, masked
    scores, heads-major ``[B, H, S]`` (-inf for a row with no visible key, which causal masking
    rules out). Both are differentiable."""
    h, g = q.shape[2], k.shape[2]
    if h % g:
        raise ValueError(f"{h} query heads are not a multiple of {g} key/value heads")
    if block_q < 1 or block_kv < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_kv={block_kv}")
    names = None if residual_names is None else tuple(residual_names)
    if (kv_segment_ids is None) != (segment_ids is None) and kv_segment_ids is not None:
        raise ValueError("kv_segment_ids needs segment_ids (the queries' own)")
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"{q.shape[1]} queries but only {k.shape[1]} keys: queries sit at q_offset.. among the keys")
    offset = jnp.asarray(q_offset, jnp.int32)
    return _flash(q, k, v, segment_ids, kv_segment_ids, offset, float(scale), int(block_q), int(block_kv), names)


def blockwise_attention(
    q: Float[Array, "B S H K"],
    k: Float[Array, "B T G K"],
    v: Float[Array, "B T G Kv"],
    *,
    scale: float,
    segment_ids: Int[Array, "B S"] | None = None,
    kv_segment_ids: Int[Array, "B T"] | None = None,
    q_offset: int | Int[Array, ""] = 0,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
    residual_names: tuple[str, str] | None = None,
) -> Float[Array, "B S H Kv"]:
    """``causal_attention``'s result, computed ``block_q`` queries by ``block_kv`` keys at a time
    (blocks clamp to S; S need not be a multiple): float32 softmax statistics whatever the input
    dtype, output in ``v.dtype``, memory linear in S, masked block pairs skipped.

    ``residual_names``: ``jax.ad_checkpoint.checkpoint_name``s for the output and lse that the
    backward pass keeps (the returned arrays carry them too); a remat policy that saves both, and
    q, k, v, never re-runs this forward. Name them here, not on the returned arrays: a name
    outside does not reach the residuals, and both together save the output twice.
    """
    return blockwise_attention_with_lse(
        q, k, v, scale=scale, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
        block_q=block_q, block_kv=block_kv, residual_names=residual_names,
    )[0]
