"""The routed experts' products as written or in FP8, for a kernel that writes its own backward
pass (:mod:`zoo.layers.capacity_mlp`).

Dimension letters: E experts · R rows (a batched pass's slots of each expert, or one tile's rows
of one expert) · K contracted · N output columns. An operand is a batched pass's ``[E, R, K]``
with the weights ``[E, K, N]``, or a tile's ``[R, K]`` with its expert's ``[K, N]``.

Tensorwise FP8 takes its scales from the caller, one per expert and tensor (:func:`expert_scale`):
from the largest magnitude of that tensor over all the expert's rows, on every device holding
some, so the products depend neither on which rows share a batched pass or a tile nor on the
mesh: one device's numerics. MXFP8 and blockwise scale blocks within each call's operands
(:func:`zoo.layers.fp8.batched_product`); a block along the rows (the weight gradients'
operands) then lies within one batched pass or one tile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, UInt8

from zoo.core.mesh import PIPELINE
from zoo.core.named import named
from zoo.hooks.step import GATHERED, Gather, current_step, gather_fsdp, varying_axes, varying_over
from zoo.layers import fp8

F32 = jnp.float32


class Scales(NamedTuple):
    """Per expert ``[E]`` tensorwise scales of the routed experts' FP8 operands: the tokens'
    rows, the three weights, and (once known) the SwiGLU's output, the output's cotangent and
    the gate's and up projection's cotangents."""

    x: Float[Array, " E"]
    w_gate: Float[Array, " E"]
    w_up: Float[Array, " E"]
    w_down: Float[Array, " E"]
    hidden: Float[Array, " E"] | None = None
    dout: Float[Array, " E"] | None = None
    dgate: Float[Array, " E"] | None = None
    dup: Float[Array, " E"] | None = None


def scale_axes(w: Float[Array, "E K N"]) -> tuple[str, ...]:
    """The mesh axes whose devices hold other rows of the same experts as this one (or the same
    rows: a largest magnitude over those is the same): every axis of the step but the pipeline's
    (other layers), and the expert axis where it splits the experts ``w`` belongs to."""
    step = current_step()
    if step is None:
        return ()
    split = varying_axes(w)
    return tuple(a for a, n in dict(step.mesh.shape).items()
                 if n > 1 and a != PIPELINE and not (a == "expert" and a in split))  # fmt: skip


def expert_scale(amax: Float[Array, " E"], dtype: DTypeLike, axes: tuple[str, ...]) -> Float[Array, " E"]:
    """Each expert's scale in FP8 ``dtype`` from its largest magnitude on this device, ``amax``,
    and on the devices across ``axes`` (:func:`scale_axes`)."""
    amax = jax.lax.stop_gradient(amax)
    if axes:
        amax = jax.lax.pmax(varying_over(amax, axes), axes)
    return fp8.scale_of(amax, dtype)


def slots_amax(a: Float[Array, "E R K"]) -> Float[Array, " E"]:
    """Each expert's largest magnitude in a batched pass's slots (empty slots are zeros)."""
    return jnp.max(jnp.abs(a.astype(F32)), axis=(1, 2))


def _q(a: Float[Array, "*E R K"], scale: Float[Array, "*E"], dtype: DTypeLike) -> tuple[Array, Float[Array, "..."]]:
    s = scale[:, None, None] if a.ndim == 3 else scale
    if a.dtype == dtype:  # codes already, at this scale (weights gathered as codes: gather_codes)
        return a, s
    return fp8.codes(a, s, dtype), s


def _t(q: tuple[Array, Array]) -> tuple[Array, Array]:
    """Codes transposed (their scale, one per expert, unchanged)."""
    return jnp.swapaxes(q[0], -1, -2), q[1]


def _one(product, a, b, recipe):
    """A block-scaled ``product`` of a tile as a batch of one (3-D operands as they are)."""
    if a.ndim == 3:
        return product(a, b, recipe)
    return product(a[None], b[None], recipe)[0]


def product(
    a: Float[Array, "*E R K"], w: Float[Array, "*E K N"], recipe: str, scales: tuple[Array, Array] | None = None
) -> Float[Array, "*E R N"]:
    """``a @ w`` in float32; ``scales``: ``a``'s and ``w``'s per-expert tensorwise scales."""
    if recipe == "none":
        if a.ndim == 3:
            return jnp.einsum("erk,ekn->ern", a, w, preferred_element_type=F32)
        return jax.lax.dot_general(a, w, (((1,), (0,)), ((), ())), preferred_element_type=F32)
    if recipe == "tensorwise":
        return fp8.scaled_dot(_q(a, scales[0], fp8.E4M3), _q(w, scales[1], fp8.E4M3))
    return _one(fp8.batched_product, a, w, recipe)


def input_grad(
    g: Float[Array, "*E R N"], w: Float[Array, "*E K N"], recipe: str, scales: tuple[Array, Array] | None = None
) -> Float[Array, "*E R K"]:
    """``g @ wᵀ`` in float32: the gradient of :func:`product`'s ``a`` for its output's cotangent
    ``g``; ``scales``: ``g``'s and ``w``'s."""
    if recipe == "none":
        if g.ndim == 3:
            return jnp.einsum("ern,ekn->erk", g, w, preferred_element_type=F32)
        return jax.lax.dot_general(g, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    if recipe == "tensorwise":
        return fp8.scaled_dot(_q(g, scales[0], fp8.E5M2), _t(_q(w, scales[1], fp8.E4M3)))
    return _one(fp8.batched_input_grad, g, w, recipe)


def weight_grad(
    a: Float[Array, "*E R K"], g: Float[Array, "*E R N"], recipe: str, scales: tuple[Array, Array] | None = None
) -> Float[Array, "*E K N"]:
    """``aᵀ @ g`` in float32: the gradient of :func:`product`'s ``w``; ``scales``: ``a``'s and ``g``'s."""
    if recipe == "none":
        if a.ndim == 3:
            return jnp.einsum("erk,ern->ekn", a, g, preferred_element_type=F32)
        return jax.lax.dot_general(a, g, (((0,), (0,)), ((), ())), preferred_element_type=F32)
    if recipe == "tensorwise":
        return fp8.scaled_dot(_t(_q(a, scales[0], fp8.E4M3)), _q(g, scales[1], fp8.E5M2))
    return _one(fp8.batched_weight_grad, a, g, recipe)


class RowCodes(NamedTuple):
    """The tokens' rows as the expert dispatch sent them (:mod:`zoo.layers.moe_dispatch`): their
    tensorwise E4M3 codes as bits, each row at its expert's scale, and each (local) expert's scale."""

    bits: UInt8[Array, "R D"]
    scale: Float[Array, " E"]

    def codes(self) -> Float[Array, "R D"]:
        """The codes in E4M3, as the products take them (:func:`product` and the gradients take
        an operand already in the format as its codes)."""
        return jax.lax.bitcast_convert_type(self.bits, fp8.E4M3)


# -- FSDP: the routed experts' weights gathered as their FP8 codes -----------------------------


class ExpertCodes(NamedTuple):
    """The routed experts' three weights (gate, up, down) as :func:`gather_codes` gathered them:
    each weight's tensorwise E4M3 codes as their bits, and each expert's scale."""

    bits: tuple[UInt8[Array, "E _ _"], ...]
    scales: tuple[Float[Array, " E"], ...]

    def codes(self) -> tuple[Float[Array, "E _ _"], ...]:
        """The codes in E4M3, as the products take them (each with its scale in :attr:`scales`:
        :func:`product` and the gradients take an operand already in the format as its codes)."""
        return tuple(jax.lax.bitcast_convert_type(b, fp8.E4M3) for b in self.bits)


def gather_codes(
    weights: Sequence[Float[Array, "E _ _"]], dims: Sequence[tuple[Gather, ...]]
) -> tuple[tuple[Float[Array, "E _ _"], ...], ExpertCodes]:
    """The routed experts' weights, each device's blocks (``weights``), FSDP-gathered on ``dims``
    as their tensorwise FP8 codes: each expert's scale is its largest magnitude over the devices
    holding its parts and its rows (:func:`scale_axes`), the one the capacity kernel takes from
    the gathered weight, so each device's block quantizes to the gathered weight's codes, and the
    gather moves a byte an element. Returns stand-ins of the gathered weights (shape, dtype and
    mesh axes; NaN, never read: the kernel reads the codes), through which the weights'
    gradients come back (reduce-scattered in the weights' dtype, as the gather's transpose), and
    the codes (:class:`ExpertCodes`) for :func:`zoo.layers.capacity_mlp.capacity_expert_mlp`."""
    out = [_gather_codes(tuple(d), tuple(sorted(set(scale_axes(w)) | {a for g in d for a in g.axes})))(w)
           for w, d in zip(weights, dims, strict=True)]  # fmt: skip
    # The codes take no gradient (the weights' comes back through the stand-ins), so a kernel
    # may close over them (the dispatch's custom VJP calls the pair MLP with the weights only).
    codes = jax.lax.stop_gradient(ExpertCodes(tuple(o[1] for o in out), tuple(o[2] for o in out)))
    return tuple(o[0] for o in out), codes


@functools.cache
def _gather_codes(dims: tuple[Gather, ...], over: tuple[str, ...]):
    def forward(w):
        scale = expert_scale(jnp.max(jnp.abs(w.astype(F32)), axis=tuple(range(1, w.ndim))), fp8.E4M3, over)
        bits = jax.lax.bitcast_convert_type(fp8.codes(w, scale[:, None, None], fp8.E4M3), jnp.uint8)
        bits = named(GATHERED, gather_fsdp, bits, dims)
        stand_in = jnp.full(bits.shape, jnp.nan, w.dtype)
        return varying_over(stand_in, tuple(sorted(varying_axes(bits)))), bits, scale

    @jax.custom_vjp
    def f(w):
        return forward(w)

    def f_fwd(w):
        return forward(w), w

    def f_bwd(w, cts):
        (dw,) = jax.linear_transpose(lambda v: gather_fsdp(v, dims), w)(cts[0])  # the gather's reduce-scatter
        return (dw,)

    f.defvjp(f_fwd, f_bwd)
    return f
