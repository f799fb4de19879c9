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

In FP8 (the precision map's ``moe_gate``, ``moe_up``, ``moe_down``: any recipe of
:mod:`zoo.layers.fp8`), every product of both passes runs in the recipe
(:mod:`zoo.layers.expert_products`). Tensorwise scales are each expert's, over all its rows on
every device (the batched pass's and the overflow's), so the step's numerics are one device's on
any mesh; the SwiGLU output's and the projections' cotangents need the overflow's rows before
any product of theirs, which a first loop over the overflow tiles finds (recomputing their
projections; no loop runs without overflow). MXFP8 and blockwise scale blocks within the
batched pass and within each tile.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from zoo.core.named import named, region
from zoo.hooks.step import sum_to_varying_of, varying_like
from zoo.layers import expert_products as ep
from zoo.layers import fp8
from zoo.layers.grouped_matmul import tile_layout
from zoo.layers.rows import take_rows

# Rows per expert in the batched pass over the mean (rows / experts): benchmarks/moe.py.
CAPACITY_FACTOR = 1.25
OVERFLOW_TILE = 32
# The routed experts' three matmuls as the precision map names them (their outputs' placement names).
MATMULS = fp8.ROUTED
NONE = ("none",) * 3


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
    ``in_capacity``, else overflow row ``pair_over[p]``; zero where not ``mine``. Overflow row
    ``j`` is expert ``over_expert[j]``'s."""

    slot_pair: Int[Array, "E C"]
    slot_valid: Bool[Array, "E C"]
    over_pair: Int[Array, " O"]
    over_valid: Bool[Array, " O"]
    over_sizes: Int[Array, " E"]
    pair_slot: Int[Array, " P"]
    pair_over: Int[Array, " P"]
    in_capacity: Bool[Array, " P"]
    mine: Bool[Array, " P"]
    over_expert: Int[Array, " O"]


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
    return CapacityLayout(slot_pair, slot_valid, over_pair, over_valid, over, pair_slot, pair_over, in_capacity, mine,
                          owner)  # fmt: skip


def _rows(x, pairs, valid, k):
    """``x`` rows of the tokens of ``pairs`` (zeros where not ``valid``)."""
    return take_rows(x, pairs // k, valid)


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


# -- tensorwise FP8: each expert's scales over all its rows ----------------------------------------


def _s(scales: ep.Scales | None, a: str, b: str, owner: Array | None = None) -> tuple[Array, Array] | None:
    """Scales ``a`` and ``b`` of a tensorwise product (an expert's: ``owner``); ``None`` where
    either is not set (that product is not tensorwise)."""
    pair = (None, None) if scales is None else (getattr(scales, a), getattr(scales, b))
    if pair[0] is None or pair[1] is None:
        return None
    return pair if owner is None else (pair[0][owner], pair[1][owner])


def _rows_amax(row_amax: Float[Array, " N"], layout: CapacityLayout, per: int) -> Float[Array, " E"]:
    """Each expert's largest ``row_amax`` over its rows, the batched pass's and the overflow's
    (pair ``p``'s row is ``row_amax[p // per]``)."""
    cap = jnp.max(jnp.where(layout.slot_valid, row_amax[layout.slot_pair // per], 0), axis=1)
    over = jnp.where(layout.over_valid, row_amax[layout.over_pair // per], 0)
    return cap.at[layout.over_expert].max(over)


def _input_scales(x, w_gate, w_up, w_down, layout, k, codes: ep.ExpertCodes | None = None,
                  rows: ep.RowCodes | None = None) -> ep.Scales:  # fmt: skip
    axes = ep.scale_axes(w_gate)
    e4m3 = functools.partial(ep.expert_scale, dtype=fp8.E4M3, axes=axes)
    weights = codes.scales if codes is not None else tuple(e4m3(ep.slots_amax(w)) for w in (w_gate, w_up, w_down))
    if rows is not None:  # the dispatch's: the same largest magnitudes, taken before the rows were sent
        return ep.Scales(rows.scale, *weights)
    x_amax = _rows_amax(jnp.max(jnp.abs(x.astype(ep.F32)), axis=1), layout, k)
    return ep.Scales(e4m3(x_amax), *weights)


def _overflow_amax(layout, x, dout, weights, k, tile, rows_of, n, likes, dtype) -> Float[Array, "V E"]:
    """Per expert, the largest magnitude of each of the ``n`` arrays ``rows_of(tile)`` computes
    from an overflow tile, over every tile (zeros without overflow)."""
    init = varying_like(jnp.zeros((n, weights[0].shape[0]), ep.F32), *likes)
    if not layout.over_pair.shape[0]:
        return init
    tiles, read = _overflow_tiles(layout, x, dout, weights, k, tile, dtype)

    def body(i, amax):
        t = read(i)
        vals = jnp.stack([jnp.max(jnp.abs(jnp.where(t.keep[:, None], v, 0).astype(ep.F32))) for v in rows_of(t)])
        return amax.at[:, t.owner].max(vals)

    return jax.lax.fori_loop(0, tiles.used, body, init)


# -- the batched pass and the overflow tiles -------------------------------------------------------


def _capacity_pass(x, w_gate, w_up, w_down, layout, k, recipes, scales, over_hidden, dtype):
    """The batched pass's output slots (in the compute ``dtype``), the tensors it keeps, and
    ``scales`` with the SwiGLU output's (from its slots and ``over_hidden``, the overflow's
    largest magnitudes) where the down projection is tensorwise."""
    rg, ru, rd = recipes
    xc = _rows(x, layout.slot_pair, layout.slot_valid, k)
    # The projections as slots, named as the rows the backward pass keeps (the placement map's
    # tensors); the SwiGLU on those rows, back into slots for the down projection. The forward
    # pass computes every named tensor (a planner's trace under full remat sees each).
    gate = named("moe_gate", lambda: _kept(layout, ep.product(xc, w_gate, rg, _s(scales, "x", "w_gate")).astype(dtype)))
    up = named("moe_up", lambda: _kept(layout, ep.product(xc, w_up, ru, _s(scales, "x", "w_up")).astype(dtype)))
    if rd != "tensorwise":
        hidden = named("moe_hidden", lambda: jax.nn.silu(gate) * up)
        hs = _slots(layout, hidden)
        return ep.product(hs, w_down, rd, _s(scales, "hidden", "w_down")).astype(hs.dtype), (gate, up, hidden), scales
    # Tensorwise: the SwiGLU output is kept as its FP8 codes, which are all the backward pass reads
    # of it (the down projection's weight gradient): a map that keeps or offloads moe_hidden keeps
    # a byte an element (as the bits: see zoo.layers.fp8._matmul), the same numbers.
    with region("moe_hidden"):
        hidden = jax.nn.silu(gate) * up
        amax = jnp.maximum(ep.slots_amax(_slots(layout, hidden)), over_hidden)
        scales = scales._replace(hidden=ep.expert_scale(amax, fp8.E4M3, ep.scale_axes(w_gate)))
        c = layout.slot_pair.shape[1]
        row_scale = scales.hidden[:, None, None] if hidden.ndim == 3 else scales.hidden[layout.pair_slot // c][:, None]
        codes = named("moe_hidden", jax.lax.bitcast_convert_type, fp8.codes(hidden, row_scale, fp8.E4M3), jnp.uint8)
    hs = _slots(layout, jax.lax.bitcast_convert_type(codes, fp8.E4M3))  # codes: the product takes them as they are
    return ep.product(hs, w_down, rd, _s(scales, "hidden", "w_down")).astype(dtype), (gate, up, codes), scales


def _overflow_any(layout) -> Array:
    return jnp.any(layout.over_sizes > 0)


def _per_pair(layout, cap_rows):
    """Each pair's row from the capacity rows; zeros for a pair not mine or past the capacity
    (the overflow loop writes those)."""
    return take_rows(cap_rows, layout.pair_slot, layout.mine & layout.in_capacity)


class _Tile(NamedTuple):
    """One tile of the overflow rows: which are valid, their pairs, the pairs' token rows and
    (backward) output gradients, zeros past the valid rows; its expert's weights and id; the
    compute dtype (the rows may be FP8 codes)."""

    keep: Array
    pair: Array
    x: Array
    dy: Array | None
    w: tuple[Array, Array, Array]
    owner: Array
    dtype: Any


def _overflow_tiles(layout, x, dout, weights, k, tile, dtype):
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
        return _Tile(keep, p, rows(x, p // k), dy, w, tiles.owner[i], dtype)

    return tiles, read


def _put(per_pair, t: _Tile, rows):
    """The tile's valid ``rows`` written into their pairs' rows of ``per_pair`` (a scatter of
    distinct rows, in place in the loop's carry: no ``[O, D]`` buffer of the overflow)."""
    at = jnp.where(t.keep, t.pair, per_pair.shape[0])  # past the end: dropped
    return per_pair.at[at].set(rows.astype(per_pair.dtype), mode="drop", unique_indices=True)


def _tile_forward(t: _Tile, recipes, scales):
    """A tile's SwiGLU output (its projections in its rows' dtype)."""
    rg, ru, _ = recipes
    gate = ep.product(t.x, t.w[0], rg, _s(scales, "x", "w_gate", t.owner)).astype(t.dtype)
    up = ep.product(t.x, t.w[1], ru, _s(scales, "x", "w_up", t.owner)).astype(t.dtype)
    return jax.nn.silu(gate) * up


def _tile_backward(t: _Tile, recipes, scales):
    """A tile's SwiGLU output recomputed, and its gate's and up projection's cotangents."""
    f32 = ep.F32
    rg, ru, rd = recipes
    go = ep.product(t.x, t.w[0], rg, _s(scales, "x", "w_gate", t.owner)).astype(t.dtype).astype(f32)
    uo = ep.product(t.x, t.w[1], ru, _s(scales, "x", "w_up", t.owner)).astype(t.dtype).astype(f32)
    ho = (jax.nn.silu(go) * uo).astype(t.dtype)
    dho = ep.input_grad(t.dy, t.w[2], rd, _s(scales, "dout", "w_down", t.owner)).astype(t.dy.dtype).astype(f32)
    dgo = (dho * uo * _silu_grad(go)).astype(t.dtype)
    duo = (dho * jax.nn.silu(go)).astype(t.dtype)
    return ho, dgo, duo


def _overflow_forward(x, w_gate, w_up, w_down, layout, k, tile, recipes, scales, out):
    """``out`` (each pair's output, ``[P, D]``) with the overflow pairs' rows written in, a tile
    at a time: each tile's rows gathered, its gate, up, hidden and output computed, only the
    output kept."""
    tiles, read = _overflow_tiles(layout, x, None, (w_gate, w_up, w_down), k, tile, out.dtype)

    def body(i, out):
        t = read(i)
        hidden = _tile_forward(t, recipes, scales)
        return _put(out, t, ep.product(hidden, t.w[2], recipes[2], _s(scales, "hidden", "w_down", t.owner)).astype(hidden.dtype))

    out = varying_like(out, x, w_gate, w_up, w_down, layout.over_sizes, *jax.tree.leaves(scales))  # one carry type
    return jax.lax.fori_loop(0, tiles.used, body, out)


def _overflow_backward(x, dout, w_gate, w_up, w_down, layout, k, tile, recipes, scales, dpair, dws):
    """``dpair`` (each pair's input gradient, ``[P, D]``) with the overflow pairs' rows written
    in, and the weight gradients ``dws`` (float32) plus theirs, a tile at a time: each tile's
    rows and output gradients gathered, its SwiGLU recomputed, its input gradient written and its
    expert's weight gradients added."""
    tiles, read = _overflow_tiles(layout, x, dout, (w_gate, w_up, w_down), k, tile, dpair.dtype)
    rg, ru, rd = recipes

    def body(i, carry):
        dx, dwg, dwu, dwd = carry
        t = read(i)
        xt = t.x  # zeros past the tile's valid rows: they add nothing to the weight gradients
        ho, dgo, duo = _tile_backward(t, recipes, scales)
        dxt = (ep.input_grad(dgo, t.w[0], rg, _s(scales, "dgate", "w_gate", t.owner)).astype(dgo.dtype)
               + ep.input_grad(duo, t.w[1], ru, _s(scales, "dup", "w_up", t.owner)).astype(duo.dtype))  # fmt: skip

        def add(g, contrib):
            return jax.lax.dynamic_update_index_in_dim(g, jax.lax.dynamic_index_in_dim(g, t.owner, keepdims=True)
                                                       + contrib[None], t.owner, 0)  # fmt: skip

        return (_put(dx, t, dxt), add(dwg, ep.weight_grad(xt, dgo, rg, _s(scales, "x", "dgate", t.owner))),
                add(dwu, ep.weight_grad(xt, duo, ru, _s(scales, "x", "dup", t.owner))),
                add(dwd, ep.weight_grad(ho, t.dy, rd, _s(scales, "hidden", "dout", t.owner))))  # fmt: skip

    likes = (x, dout, w_gate, w_up, w_down, layout.over_sizes, *jax.tree.leaves(scales))
    dpair, *dws = (varying_like(a, *likes) for a in (dpair, *dws))  # one carry type
    dpair, *dws = jax.lax.fori_loop(0, tiles.used, body, (dpair, *dws))
    return dpair, tuple(dws)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def capacity_expert_mlp(
    x: Float[Array, "T D"],
    w_gate: Float[Array, "E D M"],
    w_up: Float[Array, "E D M"],
    w_down: Float[Array, "E M D"],
    layout: CapacityLayout,
    k: int,
    tile: int = OVERFLOW_TILE,
    recipes: tuple[str, str, str] = NONE,
    codes: ep.ExpertCodes | None = None,
    rows: ep.RowCodes | None = None,
) -> Float[Array, "P D"]:
    """Each pair's expert SwiGLU output, pair ``p`` being token ``p // k``'s row through its
    expert (:func:`capacity_layout`); zeros for pairs not ``mine``. ``recipes``: the FP8 recipe
    of the gate, up and down projections (:data:`MATMULS`; ``"none"``: as written). ``codes``
    (every recipe tensorwise): the weights as :func:`zoo.layers.expert_products.gather_codes`
    gathered them, ``w_gate``, ``w_up``, ``w_down`` being its stand-ins (their gradients'
    shapes; never read): the products read the codes and their scales, and the backward pass
    keeps the codes (a byte an element), not the weights. ``rows`` (the gate and up projections
    tensorwise): the rows of ``x`` as the expert dispatch sent them, FP8 codes at each expert's
    scale (:func:`zoo.layers.moe_dispatch.exchange_experts`), ``x`` being their stand-in (the
    compute dtype and the gradient's shape; never read); the backward pass keeps the codes."""
    return _forward(x, w_gate, w_up, w_down, layout, k, tile, recipes, codes, rows)[0]


def _forward(x, w_gate, w_up, w_down, layout, k, tile, recipes, codes=None, rows=None):
    e, c = layout.slot_pair.shape
    dtype = x.dtype  # the compute dtype
    ws = (w_gate, w_up, w_down) if codes is None else codes.codes()
    scales = over_hidden = None
    if codes is not None and recipes != ("tensorwise",) * 3:
        raise ValueError(f"capacity_expert_mlp: FP8 codes for the weights of products in {recipes}: tensorwise only")
    if rows is not None:
        if recipes[:2] != ("tensorwise",) * 2:
            raise ValueError(f"capacity_expert_mlp: FP8 rows for the gate and up products in {recipes[:2]}: tensorwise only")
        x = rows.codes()
    if "tensorwise" in recipes:
        scales = _input_scales(x, *ws, layout, k, codes, rows)
        if recipes[2] == "tensorwise":  # the overflow's SwiGLU outputs, before any down product
            rows_of = lambda t: (_tile_forward(t, recipes, scales),)  # noqa: E731
            likes = (x, *ws, layout.over_sizes)
            over_hidden = _overflow_amax(layout, x, None, ws, k, tile, rows_of, 1, likes, dtype)[0]
    yc, saved, scales = _capacity_pass(x, *ws, layout, k, recipes, scales, over_hidden, dtype)
    yc = yc.reshape(e * c, -1)
    if not layout.over_pair.shape[0]:
        return _per_pair(layout, yc), saved, scales

    def overflow(x, w_gate, w_up, w_down, yc):
        return _overflow_forward(x, w_gate, w_up, w_down, layout, k, tile, recipes, scales, _per_pair(layout, yc))

    def balanced(x, w_gate, w_up, w_down, yc):
        return _per_pair(layout, yc)

    # The overflow's loop and buffers are skipped outright when no expert overflows.
    return jax.lax.cond(_overflow_any(layout), overflow, balanced, x, *ws, yc), saved, scales


def _like(a):
    """An empty array of ``a``'s dtype and mesh axes: what a stand-in tells the backward pass."""
    return varying_like(jnp.zeros((0,), a.dtype), a)


def _fwd(x, w_gate, w_up, w_down, layout, k, tile, recipes, codes=None, rows=None):
    out, saved, scales = _forward(x, w_gate, w_up, w_down, layout, k, tile, recipes, codes, rows)
    # The rows' codes, not their stand-in (a byte an element); likewise the weights' codes, which
    # the remat policy regathers, and the stand-ins' dtypes and mesh axes.
    xs = x if rows is None else (rows.bits, _like(x))
    if codes is None:
        return out, (xs, (w_gate, w_up, w_down), layout, saved, scales)
    return out, (xs, (codes, tuple(_like(w) for w in (w_gate, w_up, w_down))), layout, saved, scales)


def _silu_grad(gate):
    s = jax.nn.sigmoid(gate)
    return s * (1 + gate * (1 - s))


def _bwd(k, tile, recipes, residuals, dout):
    xs, weights, layout, kept, scales = residuals
    # The tokens' rows (their FP8 codes where the dispatch sent those) and what x's gradient is like.
    x, like = (jax.lax.bitcast_convert_type(xs[0], fp8.E4M3), xs[1]) if isinstance(xs, tuple) else (xs, xs)
    dtype = like.dtype
    given = isinstance(weights[0], ep.ExpertCodes)
    w_gate, w_up, w_down = weights[0].codes() if given else weights
    gate, up, hidden = (_slots(layout, a) for a in kept)
    if hidden.dtype == jnp.uint8:  # the SwiGLU output's FP8 codes (tensorwise down projection)
        hidden = jax.lax.bitcast_convert_type(hidden, fp8.E4M3)
    e, c = layout.slot_pair.shape
    f32 = jnp.float32
    rg, ru, rd = recipes
    ws = (w_gate, w_up, w_down)
    # Batched pass: each slot's output gradient gathered from its pair.
    dyc = take_rows(dout, layout.slot_pair, layout.slot_valid)
    xc = _rows(x, layout.slot_pair, layout.slot_valid, k)
    if scales is not None:
        amax = _rows_amax(jnp.max(jnp.abs(dout.astype(f32)), axis=1), layout, 1)
        scales = scales._replace(dout=ep.expert_scale(amax, fp8.E5M2, ep.scale_axes(w_gate)))
    dw_down = ep.weight_grad(hidden, dyc, rd, _s(scales, "hidden", "dout"))
    dhidden = ep.input_grad(dyc, w_down, rd, _s(scales, "dout", "w_down"))
    # A hand-written backward runs under its call's scopes only: each named tensor's share of it
    # goes under that tensor's scope, as autodiff's transposes would.
    with region("moe_hidden"):
        g32, u32 = gate.astype(f32), up.astype(f32)
        dgate = (dhidden * u32 * _silu_grad(g32)).astype(dtype)
        dup = (dhidden * jax.nn.silu(g32)).astype(dtype)
    if "tensorwise" in (rg, ru):  # the projections' cotangents: the overflow's too, before any product
        rows_of = lambda t: _tile_backward(t, recipes, scales)[1:]  # noqa: E731
        over = _overflow_amax(layout, x, dout, ws, k, tile, rows_of, 2, (x, dout, *ws, layout.over_sizes), dtype)
        dgate_amax, dup_amax = (jnp.maximum(ep.slots_amax(a), o) for a, o in zip((dgate, dup), over))
        e5m2 = functools.partial(ep.expert_scale, dtype=fp8.E5M2, axes=ep.scale_axes(w_gate))
        scales = scales._replace(dgate=e5m2(dgate_amax), dup=e5m2(dup_amax))
    with region("moe_gate"):
        dw_gate = ep.weight_grad(xc, dgate, rg, _s(scales, "x", "dgate"))
    with region("moe_up"):
        dw_up = ep.weight_grad(xc, dup, ru, _s(scales, "x", "dup"))
    with region("moe_gate"):
        dxc = _slots_input_grad(dgate, dup, w_gate, w_up, (rg, ru), scales).reshape(e * c, -1)

    # Overflow: recomputed a tile at a time (it is small, and usually absent), its weight
    # gradients accumulated into the batched pass's; skipped outright when no expert overflows.
    def overflow(dxc, dws):
        return _overflow_backward(x, dout, *ws, layout, k, tile, recipes, scales, _per_pair(layout, dxc), dws)

    def balanced(dxc, dws):
        return _per_pair(layout, dxc), dws

    dws = (dw_gate, dw_up, dw_down)
    if layout.over_pair.shape[0]:
        dpair, dws = jax.lax.cond(_overflow_any(layout), overflow, balanced, dxc, dws)
    else:
        dpair, dws = balanced(dxc, dws)
    # Each token's gradient: its K pairs' row gradients, gathered and summed (no scatter).
    dx = dpair if k == 1 else dpair.reshape(x.shape[0], k, -1).sum(axis=1, dtype=f32).astype(dtype)
    dws = [sum_to_varying_of(g.astype(w.dtype), w) for g, w in zip(dws, weights[1] if given else ws)]
    return (sum_to_varying_of(dx, like), *dws, None, None, None)


def _slots_input_grad(dgate, dup, w_gate, w_up, recipes=NONE[:2], scales=None):
    """The slots' gradient ``[E, C, D]`` (in ``dgate``'s dtype) through both projections, as
    one contraction over (projection, M) a block of experts at a time (at most 8 blocks): each
    block's float32 product is all that exists of it in float32, where the whole one was 6.6
    GiB at DeepSeek-V3 671B's 128-GB200 configuration (a product per projection and their sum
    held three). Each expert's product is its own; XLA:CPU's float32 results differ from one
    whole contraction's by rounding (up to 3e-6 on values of order 1: other shapes, other
    kernels), its bfloat16 ones not at all in the checks made. In FP8 (``recipes`` of the gate
    and up projections, tensorwise ones at ``scales``): each projection's product in its
    recipe, summed in float32."""
    e = dgate.shape[0]
    n = max(d for d in range(1, min(e, 8) + 1) if e % d == 0)

    def per_expert(name):  # a tensorwise scale, or ones where none is used (the blocks' map takes arrays)
        s = None if scales is None else getattr(scales, name)
        return jnp.ones((e,), jnp.float32) if s is None else s

    def block(ws):
        dg, du, wg, wu, s_dg, s_wg, s_du, s_wu = ws
        if recipes != NONE[:2]:
            rg, ru = recipes
            return (ep.input_grad(dg, wg, rg, (s_dg, s_wg)) + ep.input_grad(du, wu, ru, (s_du, s_wu))).astype(dg.dtype)
        stacked = jnp.stack([dg, du], axis=2), jnp.stack([wg, wu], axis=2)
        return jnp.einsum("ecjm,edjm->ecd", *stacked, preferred_element_type=jnp.float32).astype(dg.dtype)

    scaled = [per_expert(name) for name in ("dgate", "w_gate", "dup", "w_up")]
    blocks = tuple(a.reshape(n, e // n, *a.shape[1:]) for a in (dgate, dup, w_gate, w_up, *scaled))
    out = jax.lax.map(block, blocks)
    return out.reshape(e, *out.shape[2:])


capacity_expert_mlp.defvjp(_fwd, _bwd)
