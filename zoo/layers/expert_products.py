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

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from zoo.core.mesh import PIPELINE
from zoo.hooks.step import current_step, varying_axes, varying_over
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
