"""Expert parallelism's dispatch and combine: each device's (token, expert) pairs sent to the
devices of the ``expert`` group that hold their experts, in capacity-bounded all-to-all rounds.

A round gives every destination a slot of ``S = capacity_factor x`` the mean pairs per
destination (``P / n``): the all-to-all moves and the receiver holds ``n·S ≈ capacity_factor·P``
rows, whatever the group size ``n``. Pairs past a destination's slot either wait for further
rounds (``overflow="dropless"``: as many as the step's most loaded destination needs, agreed over
the group; the step stays exact) or are dropped (``overflow="drop"``: their output is zero and
they are counted). ``jax.lax.ragged_all_to_all`` would send just the real rows, but XLA:CPU does
not implement it (jax 0.10 to 0.12), and the tests run there.

Dimension letters: T tokens · D model width · P (token, expert) pairs (``T·K``) · N devices of
the expert group · S slot rows per destination and round · E local experts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo.core.mesh import axis_size
from zoo.errors import ConfigError
from zoo.hooks.step import current_step, varying_like
from zoo.layers.rows import take_rows

OVERFLOWS = ("dropless", "drop")
# The name scope of the later rounds' loops (forward and backward). The planner prices them as
# not run, the aux-loss-free bias keeping each destination's load within its slot
# (zoo.plan.jaxprs.later_rounds); memory is counted for them all the same.
LATER_ROUNDS = "moe_later_rounds"


@dataclass(frozen=True)
class Dispatch:
    """How expert parallelism sends pairs: ``capacity_factor`` x the mean rows per destination
    in a round, and what happens past it (``"dropless"``: more rounds; ``"drop"``: dropped and
    counted). Not architecture: a training setting, never in ``config.json``."""

    capacity_factor: float = 1.25
    overflow: str = "dropless"  # one of OVERFLOWS (checked: a clear error, not a type error)

    def __post_init__(self):
        check_dispatch(self.capacity_factor, self.overflow, "Dispatch.capacity_factor", "Dispatch.overflow")


def check_dispatch(capacity_factor: float, overflow: str, factor_name: str, overflow_name: str) -> None:
    """A clear error naming the setting that is not a positive finite factor or an overflow rule."""
    cf = capacity_factor
    if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < float("inf"):
        raise ConfigError(f"{factor_name} must be a positive finite number, got {cf!r}")
    if overflow not in OVERFLOWS:
        raise ConfigError(f"{overflow_name} must be one of {list(OVERFLOWS)}, got {overflow!r}")


def dispatch_of(config) -> Dispatch:
    """A MoE family config's dispatch settings (its ``capacity_factor`` and ``moe_overflow``
    fields), checked; an error names the config's field."""
    name = type(config).__name__
    check_dispatch(config.capacity_factor, config.moe_overflow, f"{name}.capacity_factor", f"{name}.moe_overflow")
    return Dispatch(config.capacity_factor, config.moe_overflow)


def slot_rows(pairs: int, devices: int, capacity_factor: float) -> int:
    """Rows per destination and round: ``capacity_factor`` x the mean ``pairs / devices``,
    rounded up to a multiple of 8, never more than ``pairs`` (a slot that holds every pair)."""
    rows = math.ceil(capacity_factor * pairs / devices)
    return min(pairs, max(8, -(-rows // 8) * 8))


class Exchange(NamedTuple):
    """Where each of a device's pairs goes: sorted by expert (hence by destination), pair
    ``order[j]`` is the ``j``-th; destination ``d`` gets ``count[d]`` pairs from sorted row
    ``start[d]`` on. Pair ``p`` travels in round ``round_of[p]``, in slot row ``row_of[p]`` of
    the ``N·S`` that come back."""

    order: Int[Array, " P"]
    count: Int[Array, " N"]
    start: Int[Array, " N"]
    local_expert: Int[Array, " P"]
    round_of: Int[Array, " P"]
    row_of: Int[Array, " P"]


def exchange_layout(flat: Int[Array, " P"], devices: int, local_experts: int, slot: int) -> Exchange:
    """The layout of pairs routed to global experts ``flat``, ``local_experts`` per device."""
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    dest = (flat // local_experts).astype(jnp.int32)
    count = jnp.bincount(dest, length=devices).astype(jnp.int32)
    start = jnp.cumsum(count) - count
    rank = jnp.argsort(order).astype(jnp.int32) - start[dest]  # a pair's place among its destination's
    return Exchange(order, count, start, (flat - dest * local_experts).astype(jnp.int32), rank // slot,
                    dest * slot + rank % slot)  # fmt: skip


def rounds_needed(layout: Exchange, slot: int) -> Int[Array, ""]:
    """Rounds the group's most loaded (source, destination) needs, at least one: the same on
    every device of the group, which all take part in every round's all-to-all."""
    mine = jnp.maximum(1, -(-jnp.max(layout.count) // slot))
    return jax.lax.pmax(mine, "expert")


def _round(pair_mlp, x, weights, layout: Exchange, r, k: int, slot: int):
    """Round ``r``: each destination's slot rows ``r·S ...`` sent, run through its experts, sent
    back; each pair of this round gets its output, every other pair zeros."""
    n = layout.count.shape[0]
    e_local = weights[0].shape[0]
    place = r * slot + jnp.arange(slot, dtype=jnp.int32)[None, :]  # [1, S]
    valid = place < layout.count[:, None]  # [N, S]
    pair = jnp.take(layout.order, jnp.where(valid, layout.start[:, None] + place, 0))
    send_x = take_rows(x, pair // k, valid)
    send_e = jnp.where(valid, jnp.take(layout.local_expert, pair), e_local)
    recv_x, recv_e = (jax.lax.all_to_all(a.reshape(n * slot, *a.shape[2:]), "expert", 0, 0, tiled=True)
                      for a in (send_x, send_e))  # fmt: skip
    # About P of the N·S received rows are real in the first round (each source's P/N).
    out = pair_mlp(recv_x, recv_e, 1, *weights, expected_rows=min(layout.order.shape[0], n * slot))
    back = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True)
    return take_rows(back, layout.row_of, layout.round_of == r)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def _later_rounds(pair_mlp, x, weights, layout, k, slot):
    """Rounds 1 on, as many as :func:`rounds_needed` (a loop whose trip count follows the
    routing; none when every destination's pairs fit its slot)."""
    return _later_rounds_fwd(pair_mlp, x, weights, layout, k, slot)[0]


def _zeros_like_out(x, weights, pairs):
    return varying_like(jnp.zeros((pairs, x.shape[-1]), x.dtype), x, weights[0], weights[-1])


def _later_rounds_fwd(pair_mlp, x, weights, layout, k, slot):
    body = lambda r, acc: acc + _round(pair_mlp, x, weights, layout, r, k, slot)
    zero = _zeros_like_out(x, weights, layout.order.shape[0])
    with jax.named_scope(LATER_ROUNDS):
        out = jax.lax.fori_loop(1, rounds_needed(layout, slot), body, zero)
    return out, (x, weights, layout)


def _later_rounds_bwd(pair_mlp, k, slot, residuals, dout):
    # Each later round recomputed for its gradient: rounds past the first are the rare case.
    x, weights, layout = residuals

    def body(r, grads):
        _, vjp = jax.vjp(lambda x, w: _round(pair_mlp, x, w, layout, r, k, slot), x, weights)
        dx, dw = vjp(dout)
        return grads[0] + dx, jax.tree.map(jnp.add, grads[1], dw)

    zeros = (varying_like(jnp.zeros_like(x), x), tuple(varying_like(jnp.zeros_like(w), w) for w in weights))
    with jax.named_scope(LATER_ROUNDS):
        dx, dw = jax.lax.fori_loop(1, rounds_needed(layout, slot), body, zeros)
    return dx, dw, None


_later_rounds.defvjp(_later_rounds_fwd, _later_rounds_bwd)


def exchange_experts(
    pair_mlp: Callable[..., Array],
    x: Float[Array, "T D"],
    flat: Int[Array, " P"],
    k: int,
    weights: tuple[Array, ...],
    dispatch: Dispatch,
) -> tuple[Float[Array, "P D"], Int[Array, ""]]:
    """Each local pair's expert output (pair ``p``: token ``p // k`` through global expert
    ``flat[p]``), its experts living on the devices of the ``expert`` group; and the pairs
    dropped (always 0 when ``dispatch.overflow`` is ``"dropless"``)."""
    n, e_local = axis_size(current_step().mesh, "expert"), weights[0].shape[0]
    pairs = flat.shape[0]
    slot = slot_rows(pairs, n, dispatch.capacity_factor)
    layout = exchange_layout(flat, n, e_local, slot)
    out = _round(pair_mlp, x, weights, layout, 0, k, slot)
    if dispatch.overflow == "drop":
        return out, jnp.sum(layout.round_of > 0, dtype=jnp.int32)
    if slot < pairs:  # a slot of every pair needs no second round
        out = out + _later_rounds(pair_mlp, x, weights, layout, k, slot)
    return out, jnp.zeros((), jnp.int32)
