"""Experts' SwiGLU as one batched matmul over a static capacity, the overflow through a tile loop.

Dimension letters: T tokens · K pairs per token · P (token, expert) pairs (``T·K``) · E experts ·
C capacity (rows per expert in the batched pass) · O overflow rows (``P - C``, the worst case) ·
D model width · M expert hidden.

Every expert's first ``C`` rows run as ``[E, C, D] x [E, D, M]`` batched products, at the speed
of one large matmul; a loop of per-expert tiles (:mod:`zoo.layers.grouped_matmul`) pays instead
for each expert's partly filled last tile and for each iteration. ``C`` is static, so the rows an
expert gets beyond it go through the tile loop, whose trip count follows the overflow rows
(none when the routing is balanced, as the aux-loss-free bias keeps it; the loop is then
skipped). Dropless: no capacity drops a token.

The gradient is written out (``jax.custom_vjp``) so that every data movement is a gather: the
pairs' rows are gathered into the capacity slots going forward, and the slots' gradients are
gathered back per pair and summed over each token's ``K`` pairs going backward, where autodiff
would scatter-add (slow on CPU); the overflow's weight gradients accumulate into the batched
pass's instead of into buffers of their own. What it keeps of the batched pass (``moe_gate``,
``moe_up``, ``moe_hidden``: the placement map's names) is one row per pair, not the ``E·C``
slots, whose headroom is empty rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zoo.core.named import named, region
from zoo.hooks.step import sum_to_varying_of, varying_like
from zoo.layers.grouped_matmul import tile_layout
from zoo.layers.rows import take_rows

# Rows per expert in the batched pass over the mean (rows / experts): benchmarks/moe.py.
CAPACITY_FACTOR = 1.25
OVERFLOW_TILE = 32


def capacity_for(rows: int, experts: int, factor: float = CAPACITY_FACTOR) -> int:
    """Static rows per expert of the batched pass: ``factor`` times the mean ``rows / experts``,
    rounded up to a multiple of 8."""
    mean = -(-rows // experts)
    return max(8, -(-int(factor * mean + 0.5) // 8) * 8)


class CapacityLayout(NamedTuple):
    """Where each (token, expert) pair's row goes. Capacity slot ``[e, c]`` holds pair
    ``slot_pair[e, c]`` if ``slot_valid``; overflow row ``j`` (sorted by expert,
    ``over_sizes[e]`` rows of expert ``e``, then padding) holds pair ``over_pair[j]`` if
    ``over_valid``. Pair ``p``'s output is capacity row ``pair_slot[p]`` (of the ``E·C``) if
    ``in_capacity``, else overflow row ``pair_over[p]``; zero where not ``mine``."""

    slot_pair: Int[Array, "E C"]
    slot_valid: Bool[Array, "E C"]
    over_pair: Int[Array, " O"]
    over_valid: Bool[Array, " O"]
    over_sizes: Int[Array, " E"]
    pair_slot: Int[Array, " P"]
    pair_over: Int[Array, " P"]
    in_capacity: Bool[Array, " P"]
    mine: Bool[Array, " P"]


def capacity_layout(pair_experts: Int[Array, " P"], experts: int, capacity: int) -> CapacityLayout:
    """The layout of pairs routed to ``pair_experts`` (an id of ``experts`` marks a pair that is
    not this call's: no row, zero output)."""
    e, p, c = experts, pair_experts.shape[0], capacity
    order = jnp.argsort(pair_experts, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(pair_experts, length=e + 1)[:e].astype(jnp.int32)
    first = jnp.cumsum(sizes) - sizes  # each expert's first row in the sorted order
    slot = jnp.arange(c, dtype=jnp.int32)
    slot_valid = slot[None, :] < sizes[:, None]
    slot_pair = jnp.take(order, jnp.where(slot_valid, first[:, None] + slot[None, :], 0))
    over = jnp.maximum(sizes - c, 0)
    over_first = jnp.cumsum(over) - over
    j = jnp.arange(max(p - c, 0), dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(jnp.cumsum(over), j, side="right"), e - 1).astype(jnp.int32)
    over_valid = j < jnp.sum(over)
    over_pair = jnp.take(order, jnp.where(over_valid, first[owner] + c + j - over_first[owner], 0))
    mine = pair_experts < e
    pe = jnp.where(mine, pair_experts, 0)
    within = jnp.where(mine, jnp.argsort(order).astype(jnp.int32) - first[pe], 0)
    in_capacity = within < c
    pair_slot = jnp.where(in_capacity, pe * c + within, 0)
    pair_over = jnp.where(in_capacity, 0, over_first[pe] + within - c)
    return CapacityLayout(slot_pair, slot_valid, over_pair, over_valid, over, pair_slot, pair_over, in_capacity, mine)


def _rows(x, pairs, valid, k):
    """``x`` rows of the tokens of ``pairs`` (zeros where not ``valid``)."""
    return take_rows(x, pairs // k, valid)


def _mm(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def _kept(layout, slots):
    """``slots`` as the backward pass keeps them: one row per pair (zeros for a pair without a
    slot) where the pairs are fewer than the slots (the slots' ``capacity_factor`` headroom is
    empty rows, and a map that keeps or offloads the tensor should move only the routed rows),
    else the slots themselves."""
    e, c, m = slots.shape
    if layout.pair_slot.shape[0] >= e * c:
        return slots
    return take_rows(slots.reshape(e * c, m), layout.pair_slot, layout.mine & layout.in_capacity)


def _slots(layout, kept):
    """The slots back from :func:`_kept`'s rows (bit for bit: an empty slot's row is zeros)."""
    if kept.ndim == 3:
        return kept
    return take_rows(kept, layout.slot_pair, layout.slot_valid)


def _capacity_pass(x, w_gate, w_up, w_down, layout, k):
    xc = _rows(x, layout.slot_pair, layout.slot_valid, k)
    # The projections as slots, named as the rows the backward pass keeps (the placement map's
    # tensors); the SwiGLU on those rows, back into slots for the down projection. The forward
    # pass computes every named tensor (a planner's trace under full remat sees each).
    gate = named("moe_gate", lambda: _kept(layout, _mm("ecd,edm->ecm", xc, w_gate)))
    up = named("moe_up", lambda: _kept(layout, _mm("ecd,edm->ecm", xc, w_up)))
    hidden = named("moe_hidden", lambda: jax.nn.silu(gate) * up)
    return _mm("ecm,emd->ecd", _slots(layout, hidden), w_down), (gate, up, hidden)


def _overflow_any(layout) -> Array:
    return jnp.any(layout.over_sizes > 0)


def _per_pair(layout, cap_rows):
    """Each pair's row from the capacity rows; zeros for a pair not mine or past the capacity
    (the overflow loop writes those)."""
    return take_rows(cap_rows, layout.pair_slot, layout.mine & layout.in_capacity)


def _dot(a, b, contract):
    """``a @ b`` (contracting ``a``'s dim 1 with ``b``'s ``contract``) accumulated in float32,
    rounded to ``a``'s dtype as the batched pass rounds its products."""
    return jax.lax.dot_general(a, b, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32).astype(a.dtype)


class _Tile(NamedTuple):
    """One tile of the overflow rows: which are valid, their pairs, the pairs' token rows and
    (backward) output gradients, zeros past the valid rows; its expert's weights and id."""

    keep: Array
    pair: Array
    x: Array
    dy: Array | None
    w: tuple[Array, Array, Array]
    owner: Array


def _overflow_tiles(layout, x, dout, weights, k, tile):
    """The overflow rows as tiles of ``tile`` rows, each one expert's (``tile_layout``), and a
    function reading tile ``i``: its rows gathered from ``x`` (and ``dout``) by pair, so that no
    ``[O, D]`` copy of them exists (sized for every pair to one expert, they were most of a
    layer's transient at DeepSeek-V3's scale)."""
    o = layout.over_pair.shape[0]
    tiles = tile_layout(layout.over_sizes, o, tile)
    pair = jnp.pad(layout.over_pair, (0, tile))
    valid = jnp.pad(layout.over_valid, (0, tile))

    def read(i) -> _Tile:
        p = jax.lax.dynamic_slice_in_dim(pair, tiles.first_row[i], tile)
        keep = (jnp.arange(tile) < tiles.valid[i]) & jax.lax.dynamic_slice_in_dim(valid, tiles.first_row[i], tile)
        rows = lambda a, idx: take_rows(a, idx, keep)  # noqa: E731
        w = tuple(jax.lax.dynamic_index_in_dim(a, tiles.owner[i], keepdims=False) for a in weights)
        dy = None if dout is None else rows(dout, p)
        return _Tile(keep, p, rows(x, p // k), dy, w, tiles.owner[i])

    return tiles, read


def _put(per_pair, t: _Tile, rows):
    """The tile's valid ``rows`` written into their pairs' rows of ``per_pair`` (a scatter of
    distinct rows, in place in the loop's carry: no ``[O, D]`` buffer of the overflow)."""
    at = jnp.where(t.keep, t.pair, per_pair.shape[0])  # past the end: dropped
    return per_pair.at[at].set(rows.astype(per_pair.dtype), mode="drop", unique_indices=True)


def _overflow_forward(x, w_gate, w_up, w_down, layout, k, tile, out):
    """``out`` (each pair's output, ``[P, D]``) with the overflow pairs' rows written in, a tile
    at a time: each tile's rows gathered, its gate, up, hidden and output computed, only the
    output kept."""
    tiles, read = _overflow_tiles(layout, x, None, (w_gate, w_up, w_down), k, tile)

    def body(i, out):
        t = read(i)
        hidden = jax.nn.silu(_dot(t.x, t.w[0], 0)) * _dot(t.x, t.w[1], 0)
        return _put(out, t, _dot(hidden, t.w[2], 0))

    out = varying_like(out, x, w_gate, w_up, w_down, layout.over_sizes)  # one carry type
    return jax.lax.fori_loop(0, tiles.used, body, out)


def _overflow_backward(x, dout, w_gate, w_up, w_down, layout, k, tile, dpair, dws):
    """``dpair`` (each pair's input gradient, ``[P, D]``) with the overflow pairs' rows written
    in, and the weight gradients ``dws`` (float32) plus theirs, a tile at a time: each tile's
    rows and output gradients gathered, its SwiGLU recomputed, its input gradient written and its
    expert's weight gradients added."""
    f32 = jnp.float32
    tiles, read = _overflow_tiles(layout, x, dout, (w_gate, w_up, w_down), k, tile)

    def body(i, carry):
        dx, dwg, dwu, dwd = carry
        t = read(i)
        xt = t.x  # zeros past the tile's valid rows: they add nothing to the weight gradients
        go, uo = _dot(xt, t.w[0], 0).astype(f32), _dot(xt, t.w[1], 0).astype(f32)
        ho = (jax.nn.silu(go) * uo).astype(x.dtype)
        dho = _dot(t.dy, t.w[2], 1).astype(f32)
        dgo = (dho * uo * _silu_grad(go)).astype(x.dtype)
        duo = (dho * jax.nn.silu(go)).astype(x.dtype)
        dxt = _dot(dgo, t.w[0], 1) + _dot(duo, t.w[1], 1)

        def add(g, a, b):
            contrib = jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=f32)
            return jax.lax.dynamic_update_index_in_dim(g, jax.lax.dynamic_index_in_dim(g, t.owner, keepdims=True)
                                                       + contrib[None], t.owner, 0)  # fmt: skip

        return _put(dx, t, dxt), add(dwg, xt, dgo), add(dwu, xt, duo), add(dwd, ho, t.dy)

    likes = (x, dout, w_gate, w_up, w_down, layout.over_sizes)
    dpair, *dws = (varying_like(a, *likes) for a in (dpair, *dws))  # one carry type
    dpair, *dws = jax.lax.fori_loop(0, tiles.used, body, (dpair, *dws))
    return dpair, tuple(dws)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def capacity_expert_mlp(
    x: Float[Array, "T D"],
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
    layout: CapacityLayout,
    k: int,
    tile: int = OVERFLOW_TILE,
) -> Float[Array, "P D"]:
    """Each pair's expert SwiGLU output, pair ``p`` being token ``p // k``'s row through its
    expert (:func:`capacity_layout`); zeros for pairs not ``mine``."""
    return _forward(x, w_gate, w_up, w_down, layout, k, tile)[0]


def _forward(x, w_gate, w_up, w_down, layout, k, tile):
    e, c = layout.slot_pair.shape
    yc, saved = _capacity_pass(x, w_gate, w_up, w_down, layout, k)
    yc = yc.reshape(e * c, -1)
    if not layout.over_pair.shape[0]:
        return _per_pair(layout, yc), saved

    def overflow(x, w_gate, w_up, w_down, yc):
        return _overflow_forward(x, w_gate, w_up, w_down, layout, k, tile, _per_pair(layout, yc))

    def balanced(x, w_gate, w_up, w_down, yc):
        return _per_pair(layout, yc)

    # The overflow's loop and buffers are skipped outright when no expert overflows.
    return jax.lax.cond(_overflow_any(layout), overflow, balanced, x, w_gate, w_up, w_down, yc), saved


def _fwd(x, w_gate, w_up, w_down, layout, k, tile):
    out, saved = _forward(x, w_gate, w_up, w_down, layout, k, tile)
    return out, (x, w_gate, w_up, w_down, layout, saved)


def _silu_grad(gate):
    s = jax.nn.sigmoid(gate)
    return s * (1 + gate * (1 - s))


def _bwd(k, tile, residuals, dout):
    x, w_gate, w_up, w_down, layout, kept = residuals
    gate, up, hidden = (_slots(layout, a) for a in kept)
    e, c = layout.slot_pair.shape
    f32 = jnp.float32
    # Batched pass: each slot's output gradient gathered from its pair.
    dyc = take_rows(dout, layout.slot_pair, layout.slot_valid)
    xc = _rows(x, layout.slot_pair, layout.slot_valid, k)
    dw_down = jnp.einsum("ecm,ecd->emd", hidden, dyc, preferred_element_type=f32)
    dhidden = jnp.einsum("ecd,emd->ecm", dyc, w_down, preferred_element_type=f32)
    # A hand-written backward runs under its call's scopes only: each named tensor's share of it
    # goes under that tensor's scope, as autodiff's transposes would.
    with region("moe_hidden"):
        g32, u32 = gate.astype(f32), up.astype(f32)
        dgate = (dhidden * u32 * _silu_grad(g32)).astype(x.dtype)
        dup = (dhidden * jax.nn.silu(g32)).astype(x.dtype)
    with region("moe_gate"):
        dw_gate = jnp.einsum("ecd,ecm->edm", xc, dgate, preferred_element_type=f32)
    with region("moe_up"):
        dw_up = jnp.einsum("ecd,ecm->edm", xc, dup, preferred_element_type=f32)
    with region("moe_gate"):
        dxc = _slots_input_grad(dgate, dup, w_gate, w_up).reshape(e * c, -1)

    # Overflow: recomputed a tile at a time (it is small, and usually absent), its weight
    # gradients accumulated into the batched pass's; skipped outright when no expert overflows.
    def overflow(dxc, dws):
        return _overflow_backward(x, dout, w_gate, w_up, w_down, layout, k, tile, _per_pair(layout, dxc), dws)

    def balanced(dxc, dws):
        return _per_pair(layout, dxc), dws

    dws = (dw_gate, dw_up, dw_down)
    if layout.over_pair.shape[0]:
        dpair, dws = jax.lax.cond(_overflow_any(layout), overflow, balanced, dxc, dws)
    else:
        dpair, dws = balanced(dxc, dws)
    # Each token's gradient: its K pairs' row gradients, gathered and summed (no scatter).
    dx = dpair.reshape(x.shape[0], k, -1).sum(axis=1, dtype=f32).astype(x.dtype)
    dws = [sum_to_varying_of(g.astype(w.dtype), w) for g, w in zip(dws, (w_gate, w_up, w_down))]
    return (sum_to_varying_of(dx, x), *dws, None)


def _slots_input_grad(dgate, dup, w_gate, w_up):
    """The slots' gradient ``[E, C, D]`` (in ``dgate``'s dtype) through both projections, as
    one contraction over (projection, M) a block of experts at a time (at most 8 blocks): each
    block's float32 product is all that exists of it in float32, where the whole one was 6.6
    GiB at DeepSeek-V3 671B's 128-GB200 configuration (a product per projection and their sum
    held three). Each expert's product is its own; XLA:CPU's float32 results differ from one
    whole contraction's by rounding (up to 3e-6 on values of order 1: other shapes, other
    kernels), its bfloat16 ones not at all in the checks made."""
    e = dgate.shape[0]
    n = max(d for d in range(1, min(e, 8) + 1) if e % d == 0)

    def block(ws):
        dg, du, wg, wu = ws
        stacked = jnp.stack([dg, du], axis=2), jnp.stack([wg, wu], axis=2)
        return jnp.einsum("ecjm,edjm->ecd", *stacked, preferred_element_type=jnp.float32).astype(dg.dtype)

    blocks = tuple(a.reshape(n, e // n, *a.shape[1:]) for a in (dgate, dup, w_gate, w_up))
    out = jax.lax.map(block, blocks)
    return out.reshape(e, *out.shape[2:])


capacity_expert_mlp.defvjp(_fwd, _bwd)
