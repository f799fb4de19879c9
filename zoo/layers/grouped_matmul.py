"""Grouped matmul whose work follows the data: ``out[r] = lhs[r] @ rhs[group of r]``.

Dimension letters: R rows (sorted by group) · G groups · I input width · O output width.

``jax.lax.ragged_dot`` has a grouped-matmul lowering on TPU only; on CPU and CUDA, jaxlib 0.10
expands it to a masked dense product, G times the work. This kernel runs a loop over tiles
of ``tile`` rows, each owned by one group (a group's last tile is partial), for as many
iterations as the group sizes need: the work is that of the real rows plus at most one partial
tile per group, whatever the static size of ``lhs``. Rows past ``sum(group_sizes)`` are
padding: skipped, their output zero. That is what makes a static, worst-case-sized buffer
cheap: expert parallelism receives its rows into one (:func:`zoo.layers.moe.routed_experts`).

The loop has a data-dependent trip count, which reverse-mode autodiff cannot transpose, so the
gradient is written out (``jax.custom_vjp``): ``d lhs`` is the same loop against ``rhsᵀ``, and
``d rhs[g]`` sums ``lhs_tileᵀ @ d out_tile`` over group ``g``'s tiles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo.hooks.step import sum_to_varying_of, varying_like


class Tiles(NamedTuple):
    """Rows sorted by group cut into tiles of ``tile`` rows, each owned by one group (a group's
    last tile is partial). Per tile: ``owner``, ``first_row`` (in the sorted rows) and
    ``valid`` rows; ``used``, the tiles in use (the rest own nothing: ``valid`` 0). Per group:
    ``group_first_tile`` and ``group_first_row``."""

    owner: Int[Array, " N"]
    first_row: Int[Array, " N"]
    valid: Int[Array, " N"]
    used: Int[Array, ""]
    group_first_tile: Int[Array, " G"]
    group_first_row: Int[Array, " G"]


def tile_layout(group_sizes: Int[Array, " G"], rows: int, tile: int) -> Tiles:
    """The tiles of ``rows`` sorted rows in groups of ``group_sizes``: at most
    ``ceil(rows / tile) + G`` of them, whatever the sizes."""
    g = group_sizes.shape[0]
    n_max = -(-rows // tile) + g
    sizes = group_sizes.astype(jnp.int32)
    per = -(-sizes // tile)
    end = jnp.cumsum(per)
    start = end - per
    group_first_row = jnp.cumsum(sizes) - sizes
    ids = jnp.arange(n_max, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(end, ids, side="right"), g - 1).astype(jnp.int32)
    j = ids - start[owner]
    valid = jnp.clip(sizes[owner] - j * tile, 0, tile)
    return Tiles(owner, group_first_row[owner] + j * tile, valid, end[-1], start, group_first_row)


def _zeros_like_vma(shape, dtype, *likes) -> Array:
    """Zeros typed as varying over every mesh axis ``likes`` vary over (a loop carry inside
    ``shard_map`` must keep one type)."""
    return varying_like(jnp.zeros(shape, dtype), *likes)


def _loop_matmul(lhs, rhs, group_sizes, tile: int, transpose_rhs: bool):
    """``out[r] = lhs[r] @ rhs[g]`` (or ``@ rhs[g]ᵀ``) over the tiles in use."""
    rows, width = lhs.shape
    out_width = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    owner, row0, valid, n = tile_layout(group_sizes, rows, tile)[:4]
    # Padded by one tile so a tile starting near the end is never clamped back by dynamic_slice.
    lhs = jnp.pad(lhs, ((0, tile), (0, 0)))
    contract = 1 if transpose_rhs else 0
    out = _zeros_like_vma((rows + tile, out_width), lhs.dtype, lhs, rhs, group_sizes)

    def body(i, out):
        x = jax.lax.dynamic_slice_in_dim(lhs, row0[i], tile)
        w = jax.lax.dynamic_index_in_dim(rhs, owner[i], keepdims=False)
        y = jax.lax.dot_general(x, w, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_slice_in_dim(out, row0[i], tile)
        keep = (jnp.arange(tile) < valid[i])[:, None]
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y.astype(out.dtype), old), row0[i], 0)

    return jax.lax.fori_loop(0, n, body, out)[:rows]


def _loop_weight_grad(lhs, dout, group_sizes, groups: int, tile: int, init=None):
    """``d rhs[g] = Σ lhs[r]ᵀ dout[r]`` over the rows of group ``g`` (added to ``init``, float32)."""
    rows = lhs.shape[0]
    owner, row0, valid, n = tile_layout(group_sizes, rows, tile)[:4]
    lhs = jnp.pad(lhs, ((0, tile), (0, 0)))
    dout = jnp.pad(dout, ((0, tile), (0, 0)))
    grad = _zeros_like_vma((groups, lhs.shape[1], dout.shape[1]), jnp.float32, lhs, dout, group_sizes)
    if init is not None:
        grad = grad + init  # typed as varying like the loop's operands (a carry keeps one type)

    def body(i, grad):
        keep = (jnp.arange(tile) < valid[i])[:, None]
        x = jnp.where(keep, jax.lax.dynamic_slice_in_dim(lhs, row0[i], tile), jnp.zeros((), lhs.dtype))
        d = jax.lax.dynamic_slice_in_dim(dout, row0[i], tile)
        contrib = jax.lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        old = jax.lax.dynamic_index_in_dim(grad, owner[i], keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(grad, old + contrib[None], owner[i], 0)

    return jax.lax.fori_loop(0, n, body, grad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(
    lhs: Float[Array, "R I"], rhs: Float[Array, "G I O"], group_sizes: Int[Array, " G"], tile: int = 128
) -> Float[Array, "R O"]:
    """``lhs`` rows sorted by group (``group_sizes[g]`` rows of group ``g``, then padding) times
    their group's ``rhs``; padding rows give zeros. Accumulates in float32."""
    _check(lhs, rhs, group_sizes, tile)
    return _loop_matmul(lhs, rhs, group_sizes, tile, transpose_rhs=False)


def _check(lhs, rhs, group_sizes, tile) -> None:
    """Shape errors named here, not deep inside the loop's dot."""
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"grouped_matmul: want lhs [R I], rhs [G I O], group_sizes [G]; got lhs {lhs.shape}, "
            f"rhs {rhs.shape}, group_sizes {group_sizes.shape}"
        )
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul: lhs width {lhs.shape[1]} != rhs input width {rhs.shape[1]} (rhs {rhs.shape})")
    if group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"grouped_matmul: {group_sizes.shape[0]} group sizes for {rhs.shape[0]} groups in rhs {rhs.shape}")
    if not isinstance(tile, int) or tile < 1:
        raise ValueError(f"grouped_matmul: tile must be a positive int, got {tile!r}")


def _fwd(lhs, rhs, group_sizes, tile):
    _check(lhs, rhs, group_sizes, tile)
    return _loop_matmul(lhs, rhs, group_sizes, tile, transpose_rhs=False), (lhs, rhs, group_sizes)


def _bwd(tile, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dlhs = _loop_matmul(dout, rhs, group_sizes, tile, transpose_rhs=True)
    drhs = _loop_weight_grad(lhs, dout, group_sizes, rhs.shape[0], tile).astype(rhs.dtype)
    # Inside shard_map an operand replicated over an axis the other splits (weights over "data")
    # gets its gradient summed over that axis, as autodiff does for a plain dot.
    return sum_to_varying_of(dlhs, lhs), sum_to_varying_of(drhs, rhs), None


grouped_matmul.defvjp(_fwd, _bwd)
