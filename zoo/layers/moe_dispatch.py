"""Expert parallelism's dispatch and combine: each device's (token, expert) pairs sent to the
devices of the ``expert`` group that hold their experts, in capacity-bounded all-to-all rounds.

A round gives every destination a slot of ``S = capacity_factor x`` the mean pairs per
destination (``P / n``): the all-to-all moves and the receiver holds ``n·S ≈ capacity_factor·P``
rows, whatever the group size ``n``. Pairs past a destination's slot either wait for further
rounds (``overflow="dropless"``: as many as the step's most loaded destination needs, agreed over
the group; the step stays exact) or are dropped (``overflow="drop"``: their output is zero and
they are counted).

How a round's rows travel (``transport``): a **padded** all-to-all sends every slot, filled or
not (``n·S`` rows each way); a **ragged** one (``jax.lax.ragged_all_to_all``) sends only each
destination's real rows, into the same slots, so the bytes on the wire are the routed rows. The
receiver's layout is the same either way, and so are the numerics. ``"auto"`` is ragged where
XLA implements it (GPU, TPU) and padded elsewhere: XLA:CPU does not (jax 0.10 to 0.12), so there
a forced ``"ragged"`` runs :func:`ragged_all_to_all_padded`, the same semantics by padded
all-to-alls (the tests' check of the ragged bookkeeping; it saves nothing).

In FP8 (``fp8_rows``: the routed experts' gate and up projections tensorwise, on the capacity
path), a round's token rows travel as their E4M3 codes, a byte an element, as DeepSeek-V3 sends
them: each expert's scale is the largest magnitude of the rows sent to it in the round by every
device (a ``pmax`` of an ``[N·E]`` vector), the scale its kernel would take from the rows it
receives, so the codes and the step's numbers are those of the rows sent in the compute dtype.
The outputs come back, and every gradient travels, in the compute dtype.

Dimension letters: T tokens · D model width · P (token, expert) pairs (``T·K``) · N devices of
the expert group · S slot rows per destination and round · E local experts.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from zoo.core.mesh import axis_size
from zoo.errors import ConfigError
from zoo.hooks.step import current_step, varying_axes, varying_like, varying_over
from zoo.layers import expert_products as ep
from zoo.layers import fp8
from zoo.layers.rows import take_rows

OVERFLOWS = ("dropless", "drop")
TRANSPORTS = ("auto", "padded", "ragged")
# Platforms whose XLA implements ragged_all_to_all.
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")
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
    transport: str = "auto"  # one of TRANSPORTS: how a round's rows travel (the module's docstring)

    def __post_init__(self):
        check_dispatch(self.capacity_factor, self.overflow, "Dispatch.capacity_factor", "Dispatch.overflow",
                       self.transport, "Dispatch.transport")  # fmt: skip

    def ragged(self, platform: str) -> bool:
        """Whether a round's rows travel by ``ragged_all_to_all`` on ``platform``."""
        return self.transport == "ragged" or (self.transport == "auto" and platform in RAGGED_PLATFORMS)


def check_dispatch(capacity_factor: float, overflow: str, factor_name: str, overflow_name: str,
                   transport: str = "auto", transport_name: str = "transport") -> None:  # fmt: skip
    """A clear error naming the setting that is not a positive finite factor, an overflow rule or
    a transport."""
    cf = capacity_factor
    if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < float("inf"):
        raise ConfigError(f"{factor_name} must be a positive finite number, got {cf!r}")
    if overflow not in OVERFLOWS:
        raise ConfigError(f"{overflow_name} must be one of {list(OVERFLOWS)}, got {overflow!r}")
    if transport not in TRANSPORTS:
        raise ConfigError(f"{transport_name} must be one of {list(TRANSPORTS)}, got {transport!r}")


def dispatch_of(config) -> Dispatch:
    """A MoE family config's dispatch settings (its ``capacity_factor``, ``moe_overflow`` and
    ``moe_transport`` fields), checked; an error names the config's field."""
    name = type(config).__name__
    check_dispatch(config.capacity_factor, config.moe_overflow, f"{name}.capacity_factor", f"{name}.moe_overflow",
                   config.moe_transport, f"{name}.moe_transport")  # fmt: skip
    return Dispatch(config.capacity_factor, config.moe_overflow, config.moe_transport)


_TARGET: ContextVar[str | None] = ContextVar("zoo_dispatch_platform", default=None)


@contextlib.contextmanager
def target_platform(platform: str) -> Iterator[None]:
    """Steps traced on an abstract mesh inside this block dispatch as on ``platform`` (the
    planner traces for the hardware it prices, whatever machine it runs on)."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def traced_platform() -> str:
    """The platform the current trace is for: :func:`target_platform`'s, else the default backend's."""
    return _TARGET.get() or jax.default_backend()


def mesh_platform(mesh) -> str:
    """The platform of ``mesh``'s devices; an abstract mesh has none: :func:`traced_platform`."""
    try:
        return mesh.devices.flat[0].platform
    except (AttributeError, ValueError):  # jax's AbstractMesh raises ValueError
        return traced_platform()


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
    sorted_at: Int[Array, " P"]  # pair p is the sorted_at[p]-th: the inverse of order


def exchange_layout(flat: Int[Array, " P"], devices: int, local_experts: int, slot: int) -> Exchange:
    """The layout of pairs routed to global experts ``flat``, ``local_experts`` per device."""
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    dest = (flat // local_experts).astype(jnp.int32)
    count = jnp.bincount(dest, length=devices).astype(jnp.int32)
    start = jnp.cumsum(count) - count
    sorted_at = jnp.argsort(order).astype(jnp.int32)
    rank = sorted_at - start[dest]  # a pair's place among its destination's
    return Exchange(order, count, start, (flat - dest * local_experts).astype(jnp.int32), rank // slot,
                    dest * slot + rank % slot, sorted_at)  # fmt: skip


def rounds_needed(layout: Exchange, slot: int) -> Int[Array, ""]:
    """Rounds the step's most loaded (source, destination) needs, at least one: the same on
    every device of the mesh. Every device of the expert group takes part in every round's
    all-to-all, and the backward loop's weight gradients are summed over the other axes that
    split the batch (FSDP's), whose devices are in other expert groups: a trip count agreed
    over the group only hung the step where two groups needed different counts."""
    mine = jnp.maximum(1, -(-jnp.max(layout.count) // slot))
    axes = tuple(current_step().mesh.axis_names)
    return jax.lax.pmax(varying_over(mine, axes), axes)


def ragged_all_to_all_padded(
    operand: Shaped[Array, "R *rest"],
    output: Shaped[Array, "O *rest"],
    input_offsets: Int[Array, " N"],
    send_sizes: Int[Array, " N"],
    output_offsets: Int[Array, " N"],
    recv_sizes: Int[Array, " N"],
    *,
    axis_name: str,
    max_rows: int,
) -> Shaped[Array, "O *rest"]:
    """``jax.lax.ragged_all_to_all`` (one slice per device) by a padded all-to-all of
    ``max_rows`` rows per destination, no slice being longer: the same result, the padded bytes
    moved. For backends whose XLA lacks the ragged collective (XLA:CPU)."""
    n, i = input_offsets.shape[0], jnp.arange(max_rows, dtype=jnp.int32)
    at_src = jnp.where(i < send_sizes[:, None], input_offsets[:, None] + i, operand.shape[0])  # out of range: zeros
    send = jnp.take(operand, at_src, axis=0, mode="fill", fill_value=0)  # [N, m, ...]
    recv = jax.lax.all_to_all(send.reshape(n * max_rows, *operand.shape[1:]), axis_name, 0, 0, tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source's rows go here
    # Out of range, each its own place (the indices are unique: a transposable scatter): not written.
    past = output.shape[0] + jnp.arange(n * max_rows, dtype=jnp.int32).reshape(n, max_rows)
    dest = jnp.where(i < recv_sizes[:, None], at[:, None] + i, past)
    return output.at[dest.reshape(-1)].set(recv, mode="drop", unique_indices=True)


def _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, emulate: bool, max_rows: int):
    if emulate:
        return ragged_all_to_all_padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                        axis_name="expert", max_rows=max_rows)  # fmt: skip
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name="expert")  # fmt: skip


def _slot_pairs(layout: Exchange, r, slot: int, e_local: int) -> tuple[Int[Array, "N S"], Int[Array, "N S"]]:
    """Round ``r``'s slots: the pair in each destination's slot row (any where empty) and its
    local expert (``e_local`` where empty: no pair)."""
    place = r * slot + jnp.arange(slot, dtype=jnp.int32)[None, :]  # [1, S]
    valid = place < layout.count[:, None]  # [N, S]
    pair = jnp.take(layout.order, jnp.where(valid, layout.start[:, None] + place, 0))
    return pair, jnp.where(valid, jnp.take(layout.local_expert, pair), e_local)


# -- a round's token rows, gathered and sent (in FP8: as their codes) ---------------------------


def _slot_rows(x, index, *, k: int):
    """The ``N·S`` slot rows (``index``: each slot's pair and whether it has one; zeros if not)."""
    pair, valid = index
    return take_rows(x, pair // k, valid).reshape(-1, x.shape[-1])


def _padded_send(rows, index):
    return jax.lax.all_to_all(rows, "expert", 0, 0, tiled=True)


def _sorted_rows(x, index, *, k: int):
    """The pairs' token rows sorted by expert (``index[0]``: the order)."""
    return jnp.take(x, index[0] // k, axis=0)


def _ragged_send(rows, index, *, slot: int, emulate: bool):
    """Each destination's ``sent`` rows from ``first`` on into the sender's slot of its ``N·S``."""
    _, first, sent, slot_here, recv_sizes = index
    out = varying_like(jnp.zeros((sent.shape[0] * slot, rows.shape[-1]), rows.dtype), rows)
    return _ragged(rows, out, first, sent, slot_here, recv_sizes, emulate=emulate, max_rows=slot)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sent_in_fp8(gather, send, x, index, row_scale):
    """``send(gather(x, index), index)`` (rows of ``x`` gathered and sent: linear in ``x``), the
    rows travelling as their E4M3 codes, row ``i`` at ``row_scale[i]``. Returns a stand-in of
    the received rows (NaN in ``x``'s dtype, of their shape and mesh axes; never read), through
    which their gradient comes back in ``x``'s dtype (the transposed gather and send), and the
    codes' bits as received."""
    return _sent_in_fp8_fwd(gather, send, x, index, row_scale)[0]


def _sent_in_fp8_fwd(gather, send, x, index, row_scale):
    rows = gather(x, index)
    bits = send(jax.lax.bitcast_convert_type(fp8.codes(rows, row_scale[:, None], fp8.E4M3), jnp.uint8), index)
    stand_in = varying_over(jnp.full(bits.shape, jnp.nan, x.dtype), tuple(sorted(varying_axes(bits))))
    return (stand_in, bits), (x, index)


def _sent_in_fp8_bwd(gather, send, residuals, cts):
    x, index = residuals
    (dx,) = jax.linear_transpose(lambda v: send(gather(v, index), index), x)(cts[0])
    return dx, None, None


_sent_in_fp8.defvjp(_sent_in_fp8_fwd, _sent_in_fp8_bwd)


def _pair_experts(layout: Exchange, slot: int, e_local: int) -> Int[Array, " P"]:
    """Each pair's expert among the group's ``N·E`` (its destination's ``e_local`` first)."""
    return (layout.row_of // slot) * e_local + layout.local_expert


def _round_scales(x, layout: Exchange, r, k: int, slot: int, e_local: int, axes: tuple[str, ...]) -> Array:
    """Each of the group's ``N·E`` experts' E4M3 scale of round ``r``'s rows: the largest
    magnitude of the rows every device sends it this round (``pmax`` over ``axes``), the scale
    its kernel takes from the rows it receives (:mod:`zoo.layers.capacity_mlp`)."""
    n, pairs = layout.count.shape[0], layout.order.shape[0]
    amax = jnp.take(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1), jnp.arange(pairs) // k)
    amax = jnp.where(layout.round_of == r, amax, 0)
    amax = varying_like(jnp.zeros((n * e_local,), jnp.float32), amax).at[_pair_experts(layout, slot, e_local)].max(amax)
    return ep.expert_scale(amax, fp8.E4M3, axes)


def _send_rows(x, layout: Exchange, r, k: int, slot: int, e_local: int, fp8_rows, gather, send, index, expert):
    """The received rows of round ``r`` and the pair MLP's keyword for them: none in the compute
    dtype; in FP8 (``fp8_rows``: the scales' mesh axes), a stand-in and the codes
    (:class:`zoo.layers.expert_products.RowCodes`, each local expert's scale). ``expert``: each
    sent row's expert among the group's."""
    if fp8_rows is None:
        return send(gather(x, index), index), {}
    scale = _round_scales(x, layout, r, k, slot, e_local, fp8_rows)
    n = layout.count.shape[0]
    stand_in, bits = _sent_in_fp8(gather, send, x, index, jnp.take(scale, jnp.minimum(expert, n * e_local - 1)))
    local = jax.lax.dynamic_slice_in_dim(scale, jax.lax.axis_index("expert") * e_local, e_local)
    return stand_in, {"rows": ep.RowCodes(bits, local)}


def _round_ragged(pair_mlp, x, weights, layout: Exchange, r, k: int, slot: int, emulate: bool, extra=None,
                  fp8_rows=None):  # fmt: skip
    """Round ``r`` as :func:`_round` computes it, the rows travelling by ragged all-to-alls:
    each destination's real rows of the round (at most ``S``) land in the sender's slot of the
    same ``N·S`` received rows, and come back to their places among the sender's sorted pairs."""
    n, pairs = layout.count.shape[0], layout.order.shape[0]
    e_local = weights[0].shape[0]
    sent = jnp.clip(layout.count - r * slot, 0, slot)  # [N] rows to each destination this round
    first = layout.start + r * slot  # [N] where they start among the sorted pairs
    recv_sizes = jax.lax.all_to_all(sent, "expert", 0, 0, tiled=True)  # [N] rows from each source
    slot_here = varying_like(jnp.full((n,), slot, jnp.int32), sent) * jax.lax.axis_index("expert")
    move = functools.partial(_ragged, emulate=emulate, max_rows=slot)
    # The pairs' token rows, sorted by expert, each destination's of this round sent.
    index = (layout.order, first, sent, slot_here, recv_sizes)
    expert = jnp.take(_pair_experts(layout, slot, e_local), layout.order)
    recv_x, rows = _send_rows(x, layout, r, k, slot, e_local, fp8_rows, functools.partial(_sorted_rows, k=k),
                              functools.partial(_ragged_send, slot=slot, emulate=emulate), index, expert)  # fmt: skip
    # The expert ids by a padded all-to-all: 4 bytes a slot, where XLA:TPU's ragged one pads
    # each row to 128 lanes (512 bytes a row of one id).
    _, send_e = _slot_pairs(layout, r, slot, e_local)
    recv_e = jax.lax.all_to_all(send_e.reshape(n * slot), "expert", 0, 0, tiled=True)
    out = pair_mlp(recv_x, recv_e, 1, *weights, expected_rows=min(pairs, n * slot), **(extra or {}), **rows)
    mine = jnp.arange(n, dtype=jnp.int32) * slot  # source s's rows are in slot s
    back_at = jax.lax.all_to_all(first, "expert", 0, 0, tiled=True)  # where they came from at source s
    back = move(out, varying_like(jnp.zeros((pairs, out.shape[-1]), out.dtype), out), varying_like(mine, sent),
                recv_sizes, back_at, sent)  # fmt: skip
    return jnp.take(back, layout.sorted_at, axis=0)  # zeros for the pairs of other rounds


def _round(pair_mlp, x, weights, layout: Exchange, r, k: int, slot: int, ragged: str = "no", extra=None,
           fp8_rows=None):  # fmt: skip
    """Round ``r``: each destination's slot rows ``r·S ...`` sent, run through its experts, sent
    back; each pair of this round gets its output, every other pair zeros. ``ragged``: ``"no"``
    (padded all-to-alls), ``"xla"`` (``ragged_all_to_all``) or ``"emulated"``. ``extra``:
    keyword arguments of ``pair_mlp`` that take no gradient (the experts' FP8 codes).
    ``fp8_rows``: the token rows travel as FP8 codes, their scales taken over these mesh axes
    (``None``: in the compute dtype)."""
    if ragged != "no":
        return _round_ragged(pair_mlp, x, weights, layout, r, k, slot, emulate=ragged == "emulated", extra=extra,
                             fp8_rows=fp8_rows)  # fmt: skip
    n, e_local = layout.count.shape[0], weights[0].shape[0]
    pair, send_e = _slot_pairs(layout, r, slot, e_local)
    # Each slot's expert among the group's (an empty slot's row is zeros: any scale will do).
    expert = (jnp.arange(n, dtype=jnp.int32)[:, None] * e_local + send_e).reshape(-1)
    recv_x, rows = _send_rows(x, layout, r, k, slot, e_local, fp8_rows, functools.partial(_slot_rows, k=k),
                              _padded_send, (pair, send_e < e_local), expert)  # fmt: skip
    recv_e = jax.lax.all_to_all(send_e.reshape(n * slot), "expert", 0, 0, tiled=True)
    # About P of the N·S received rows are real in the first round (each source's P/N).
    out = pair_mlp(recv_x, recv_e, 1, *weights, expected_rows=min(layout.order.shape[0], n * slot), **(extra or {}),
                   **rows)  # fmt: skip
    back = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True)
    return take_rows(back, layout.row_of, layout.round_of == r)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5, 6, 8))
def _later_rounds(pair_mlp, x, weights, layout, k, slot, ragged, extra, fp8_rows):
    """Rounds 1 on, as many as :func:`rounds_needed` (a loop whose trip count follows the
    routing; none when every destination's pairs fit its slot)."""
    return _later_rounds_fwd(pair_mlp, x, weights, layout, k, slot, ragged, extra, fp8_rows)[0]


def _zeros_like_out(x, weights, pairs):
    return varying_like(jnp.zeros((pairs, x.shape[-1]), x.dtype), x, weights[0], weights[-1])


def _later_rounds_fwd(pair_mlp, x, weights, layout, k, slot, ragged, extra, fp8_rows):
    body = lambda r, acc: acc + _round(pair_mlp, x, weights, layout, r, k, slot, ragged, extra, fp8_rows)
    zero = _zeros_like_out(x, weights, layout.order.shape[0])
    with jax.named_scope(LATER_ROUNDS):
        out = jax.lax.fori_loop(1, rounds_needed(layout, slot), body, zero)
    return out, (x, weights, layout, extra)


def _later_rounds_bwd(pair_mlp, k, slot, ragged, fp8_rows, residuals, dout):
    # Each later round recomputed for its gradient: rounds past the first are the rare case.
    x, weights, layout, extra = residuals

    def body(r, grads):
        _, vjp = jax.vjp(lambda x, w: _round(pair_mlp, x, w, layout, r, k, slot, ragged, extra, fp8_rows), x, weights)
        dx, dw = vjp(dout)
        return grads[0] + dx, jax.tree.map(jnp.add, grads[1], dw)

    zeros = (varying_like(jnp.zeros_like(x), x), tuple(varying_like(jnp.zeros_like(w), w) for w in weights))
    with jax.named_scope(LATER_ROUNDS):
        dx, dw = jax.lax.fori_loop(1, rounds_needed(layout, slot), body, zeros)
    return dx, dw, None, None


_later_rounds.defvjp(_later_rounds_fwd, _later_rounds_bwd)


def exchange_experts(
    pair_mlp: Callable[..., Array],
    x: Float[Array, "T D"],
    flat: Int[Array, " P"],
    k: int,
    weights: tuple[Array, ...],
    dispatch: Dispatch,
    extra: Mapping[str, Any] | None = None,
    *,
    fp8_rows: bool = False,
) -> tuple[Float[Array, "P D"], Int[Array, ""]]:
    """Each local pair's expert output (pair ``p``: token ``p // k`` through global expert
    ``flat[p]``), its experts living on the devices of the ``expert`` group; and the pairs
    dropped (always 0 when ``dispatch.overflow`` is ``"dropless"``). ``extra``: keyword
    arguments of ``pair_mlp`` that take no gradient (the experts' FP8 codes:
    :func:`zoo.layers.expert_products.gather_codes`). ``fp8_rows``: the token rows travel as
    their E4M3 codes (``pair_mlp`` the capacity kernel with tensorwise gate and up projections,
    which takes them as ``rows``: the module's docstring)."""
    mesh = current_step().mesh
    n, e_local = axis_size(mesh, "expert"), weights[0].shape[0]
    pairs = flat.shape[0]
    slot = slot_rows(pairs, n, dispatch.capacity_factor)
    layout = exchange_layout(flat, n, e_local, slot)
    platform = mesh_platform(mesh)
    ragged = "no" if not dispatch.ragged(platform) else "xla" if platform in RAGGED_PLATFORMS else "emulated"
    # The rows' scales over every axis of the step but the pipeline's (the experts' rows on
    # every device: expert_products.scale_axes) and the expert group's (the senders).
    axes = tuple(sorted({*ep.scale_axes(weights[0]), "expert"})) if fp8_rows else None
    first = functools.partial(_round, pair_mlp, x, weights, layout, 0, k, slot, ragged, extra, axes)
    if dispatch.overflow == "drop":
        return first(), jnp.sum(layout.round_of > 0, dtype=jnp.int32)
    if slot >= pairs:  # a slot of every pair needs no second round
        return first(), jnp.zeros((), jnp.int32)
    # The later rounds traced first: the backward pass runs in reverse, so the first round's
    # backward pass, and the release of the received rows and slots it keeps, comes before the
    # later rounds' loop in trace order. (XLA:TPU's and XLA:CPU's peaks are the same either way:
    # their schedulers order the two; the planner's walk follows trace order, and this one is
    # XLA:TPU's: docs/planning.md, "Caveats".)
    later = _later_rounds(pair_mlp, x, weights, layout, k, slot, ragged, extra, axes)
    return first() + later, jnp.zeros((), jnp.int32)
