"""FP8 matmuls: tensorwise current scaling, MXFP8 and DeepSeek-V3's blockwise recipe.

Dimension letters: E leading batch (experts; any number of dims, flattened) · T rows
(tokens) · K contracted · N output columns.

A recipe quantizes both operands of a matmul to FP8 with a scale per block, runs the product
of the dequantized operands with float32 accumulation, and, in the backward pass, quantizes
the output's cotangent and the operands again along each gradient matmul's own contracted
dimension (straight-through: the scales come from each block's maximum, so nothing is clipped):

- ``"tensorwise"``: one float32 scale per tensor (per expert for batched weights), amax / 448,
  computed from the tensor itself ("current scaling", Transformer Engine's
  ``Float8CurrentScaling``); E4M3 forward, E5M2 cotangents (its ``HYBRID`` format).
- ``"mxfp8"``: the OCP MX format: blocks of 32 consecutive elements along the contracted
  dimension, each with a power-of-two (E8M0) scale, amax / 448 rounded up to a power of two as
  ``jax.nn.scaled_dot_general`` rounds it; E4M3 everywhere.
- ``"blockwise"``: DeepSeek-V3's (its technical report, section 3.3): activations and cotangents in
  1x128 tiles along the contracted dimension, weights in 128x128 blocks, float32 scales
  amax / 448; E4M3 everywhere.
- ``"none"``: ``jnp.einsum`` as written, the model's own numerics.

Which matmul runs which recipe is the family's precision map (:mod:`zoo.precision`), active
during a trace through :func:`using`; model code calls :func:`matmul` with the matmul's name.
Tensorwise products are FP8 x FP8 dots in the program (float32 accumulation, both scales
applied to the result), the form a GPU runs; MXFP8 and blockwise multiply the dequantized
operands (FP8 value times its block's scale) in float32, except MXFP8 on CUDA, where each
product is XLA's block-scaled FP8 dot (:func:`block_dot`). Either way the numerics are the
recipe's own, reproducible by NumPy (``tests/test_fp8.py``). The backward pass keeps each weight as given (it is quantized again,
identically) and the activation's FP8 copy quantized for the weight gradient: half a bfloat16
activation's bytes, plus its scales.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike
from jaxtyping import Array, Float, UInt8

from zoo.core.mesh import PIPELINE
from zoo.core.named import named
from zoo.errors import ConfigError
from zoo.hooks import products
from zoo.hooks.step import (
    GATHERED,
    ROUTED_EXPERTS,
    Gather,
    deferred_gather,
    gather_fsdp,
    gathered_by_product,
    gathered_shape,
    varying_axes,
    varying_over,
)

Recipe = Literal["none", "tensorwise", "mxfp8", "blockwise"]
RECIPES: tuple[str, ...] = get_args(Recipe)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MX_BLOCK = 32  # MXFP8's block along the contracted dimension
E8M0 = jnp.float8_e8m0fnu  # MXFP8's scales, powers of two
# The routed experts' three matmuls as every family's precision map names them (their outputs'
# placement names): zoo.layers.capacity_mlp's products.
ROUTED = ("moe_gate", "moe_up", "moe_down")
TILE = 128  # DeepSeek-V3's activation tile and weight block

_ACTIVE: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("zoo_fp8_recipes", default=None)
_FP8_GATHERS: contextvars.ContextVar[bool] = contextvars.ContextVar("zoo_fp8_gathers", default=True)
_FP8_DISPATCH: contextvars.ContextVar[bool] = contextvars.ContextVar("zoo_fp8_dispatch", default=True)


@contextlib.contextmanager
def fp8_gathers(enabled: bool) -> Iterator[None]:
    """Whether a tensorwise or blockwise product's layer weight is FSDP-gathered as its FP8 codes
    (:func:`gathered_einsum`; the default) or in the compute dtype, as every other weight, for
    the traces made within. The step's numbers are the same either way, bit for bit; the gather
    moves half a bfloat16 weight's bytes (a quarter of float32's). ``False``: the peer the
    benchmarks measure it against (``benchmarks/fp8_gathers.py``)."""
    token = _FP8_GATHERS.set(bool(enabled))
    try:
        yield
    finally:
        _FP8_GATHERS.reset(token)


@contextlib.contextmanager
def fp8_dispatch(enabled: bool) -> Iterator[None]:
    """Whether the expert dispatch sends the tokens' rows as their FP8 codes where the routed
    experts' gate and up projections are tensorwise (:func:`dispatch_in_fp8`; the default) or in
    the compute dtype, for the traces made within. The step's numbers are the same either way,
    bit for bit. ``False``: the peer the benchmarks measure it against."""
    token = _FP8_DISPATCH.set(bool(enabled))
    try:
        yield
    finally:
        _FP8_DISPATCH.reset(token)


def dispatch_in_fp8() -> bool:
    """Whether the expert dispatch sends the tokens' rows as E4M3 codes: the active map's
    ``moe_gate`` and ``moe_up`` (the rows' two products) tensorwise, and :func:`fp8_dispatch` on.
    (:mod:`zoo.layers.moe_dispatch`; the outputs and every gradient travel in the compute dtype.)"""
    return _FP8_DISPATCH.get() and recipe_of(ROUTED[0]) == recipe_of(ROUTED[1]) == "tensorwise"


@contextlib.contextmanager
def using(recipes: Mapping[str, str] | None) -> Iterator[None]:
    """Trace the enclosed model code with ``recipes`` (matmul name -> recipe); ``None``: every
    matmul as written. :func:`zoo.layers.precision.using` gives a family's map this way. Enter it
    inside the jitted function: ``jax.jit`` caches a trace by its arguments, not by this context.

    Inside the parallel step, a tensorwise or blockwise product's layer weight is gathered by the
    product as its FP8 codes (:func:`matmul`), not by :func:`zoo.hooks.step.gather_layer` in the
    compute dtype (the routed experts' where all three are tensorwise)."""
    for name, recipe in (recipes or {}).items():
        if recipe not in RECIPES:
            raise ConfigError(f"matmul {name!r}: unknown FP8 recipe {recipe!r}; choose one of {RECIPES}")
    token = _ACTIVE.set(dict(recipes) if recipes is not None else None)
    try:
        on = _FP8_GATHERS.get()
        gathered = {n for n, r in (recipes or {}).items() if r in GATHERED_RECIPES} if on else set()
        if on and all((recipes or {}).get(n) == "tensorwise" for n in ROUTED):
            gathered.add(ROUTED_EXPERTS)  # the routed experts' kernel takes their codes (expert_products.gather_codes)
        with gathered_by_product(gathered):
            yield
    finally:
        _ACTIVE.reset(token)


def recipe_of(name: str) -> str:
    """The recipe the active map gives matmul ``name`` (``"none"`` with no map)."""
    recipes = _ACTIVE.get()
    if recipes is None:
        return "none"
    if name not in recipes:
        raise ConfigError(
            f"the active precision map names no matmul {name!r} (it names {', '.join(recipes)}): "
            "the family's model code and its precision map disagree"
        )
    return recipes[name]


# -- quantization ----------------------------------------------------------------------------


def quantize(
    x: Float[Array, "..."], dtype: DTypeLike, block: tuple[int, ...], *, power_of_two: bool = False,
    over: tuple[str, ...] = (),
) -> tuple[Array, Float[Array, "..."]]:
    """``x`` in FP8 ``dtype`` with one float32 scale per block: ``(q, scale)``, ``x ≈ q · scale``.

    ``block[i]``: the block's extent along dimension ``i`` (``0``: the whole dimension). A
    dimension that the block does not divide ends in a partial block. Each scale is the block's
    largest magnitude times the reciprocal of the format's largest value (in float32, at least its
    smallest normal number; rounded up to a power of two with ``power_of_two``; 1 for an all-zero
    block), so no element saturates. ``over``: mesh axes ``x`` is split over inside ``shard_map``,
    whose devices' blocks are parts of one block (each block's largest magnitude is theirs).
    """
    if len(block) != x.ndim:
        raise ValueError(f"a block of {len(block)} dims for a tensor of shape {x.shape}")
    shape = x.shape
    block = tuple(n if b == 0 else b for b, n in zip(block, shape, strict=True))
    padded = tuple(-(-n // b) * b for n, b in zip(shape, block, strict=True))
    xb = jnp.pad(x.astype(jnp.float32), [(0, p - n) for n, p in zip(shape, padded, strict=True)])
    xb = xb.reshape([d for p, b in zip(padded, block, strict=True) for d in (p // b, b)])
    inner = tuple(range(1, 2 * x.ndim, 2))
    amax = jnp.max(jnp.abs(xb), axis=inner, keepdims=True)
    if over:
        amax = jax.lax.pmax(amax, over)
    scale = scale_of(amax, dtype, power_of_two=power_of_two)
    q = codes(xb, scale, dtype).reshape(padded)
    q = q[tuple(slice(0, n) for n in shape)]
    return q, scale.reshape([p // b for p, b in zip(padded, block, strict=True)])


def scale_of(amax: Float[Array, "*S"], dtype: DTypeLike, *, power_of_two: bool = False) -> Float[Array, "*S"]:
    """The float32 scale of a block whose largest magnitude is ``amax`` (:func:`quantize`'s)."""
    fmax = float(jnp.finfo(dtype).max)
    # Times the float32 reciprocal, as XLA computes a division by a constant anyway; at least the
    # smallest normal float32: XLA flushes a subnormal scale to zero (0 / 0 in a block of tiny
    # values, NaN), and the block's values over it stay within the format's range.
    scale = jnp.maximum(amax * jnp.float32(1 / fmax), jnp.finfo(jnp.float32).tiny)
    if power_of_two:  # the next power of two at or above (E8M0): exact, from the exponent
        mantissa, exponent = jnp.frexp(scale)
        scale = jnp.where(mantissa == 0.5, scale, jnp.ldexp(jnp.ones_like(scale), exponent))
    return jnp.where(amax > 0, scale, 1.0)


def codes(x: Float[Array, "..."], scale: Float[Array, "..."], dtype: DTypeLike) -> Array:
    """``x / scale`` (``scale`` broadcast against ``x``) in FP8 ``dtype``, clipped to its range."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def dequantize(q: Array, scale: Float[Array, "..."], block: tuple[int, ...]) -> Float[Array, "..."]:
    """``q · scale`` in float32, each scale spread over its block (``block`` as :func:`quantize`'s)."""
    for axis, (b, n) in enumerate(zip(block, q.shape, strict=True)):
        scale = jnp.repeat(scale, n if b == 0 else b, axis=axis)[(slice(None),) * axis + (slice(0, n),)]
    return q.astype(jnp.float32) * scale


def _blocks(recipe: str, lead: int) -> dict[str, tuple[tuple[int, ...], DTypeLike]]:
    """Each operand's block and format in each of the three matmuls of ``[E.., T, K] @ [E.., K, N]``
    (``lead`` leading batch dims, one block each): ``x``/``w`` forward, ``g``/``w_t`` for the
    input's gradient (contracting N), ``x_t``/``g_t`` for the weight's (contracting T)."""
    e = (1,) * lead
    if recipe == "tensorwise":
        whole = (*e, 0, 0)
        return {k: (whole, E5M2 if k.startswith("g") else E4M3) for k in ("x", "w", "g", "w_t", "x_t", "g_t")}
    b = MX_BLOCK if recipe == "mxfp8" else TILE
    weight = (*e, b, b) if recipe == "blockwise" else None
    return {
        "x": ((*e, 1, b), E4M3),
        "w": (weight or (*e, b, 1), E4M3),
        "g": ((*e, 1, b), E4M3),
        "w_t": (weight or (*e, 1, b), E4M3),
        "x_t": ((*e, b, 1), E4M3),
        "g_t": ((*e, b, 1), E4M3),
    }


def _dot(a: Float[Array, "*E T K"], b: Float[Array, "*E K N"]) -> Float[Array, "*E T N"]:
    lead = tuple(range(a.ndim - 2))
    dims = (((a.ndim - 1,), (a.ndim - 2,)), (lead, lead))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _mT(a: Array) -> Array:
    return jnp.swapaxes(a, -1, -2)


class SharedInput(NamedTuple):
    """An input's FP8 copy for the weight gradients of every matmul reading it, quantized once
    (:func:`shared_input`): the codes as their bits, laid out as the matmuls' ``[*E, T, K]``
    operand, their scales, and the recipe."""

    bits: UInt8[Array, "*E T K"]
    scale: Float[Array, "*E t k"]  # one per block
    recipe: str


def fp8_matmul(
    x: Float[Array, "*E T K"], w: Float[Array, "*E K N"], recipe: str, *, saved: str | None = None,
    shared: SharedInput | None = None,
) -> Float[Array, "*E T N"]:
    """``x @ w`` as ``recipe`` computes it (float32 accumulation, result in ``x``'s dtype).

    ``saved``: the placement name of ``x``. The FP8 copy of ``x`` the backward pass keeps (and
    its scales) then carries that name, so a placement map that keeps or offloads ``x`` keeps or
    offloads the FP8 copy instead: half a bfloat16 tensor's bytes, the same numerics (the backward
    pass reads the FP8 copy either way). ``shared``: that copy, made once for every matmul
    reading ``x`` (:func:`shared_input`), in place of this matmul's own."""
    if recipe not in RECIPES or recipe == "none":
        raise ConfigError(f"fp8_matmul: recipe {recipe!r} is not an FP8 recipe; choose one of {RECIPES[1:]}")
    # Inside shard_map both operands enter varying over the axes either varies over: the gradient
    # rule then returns each cotangent with its operand's type, and the casts' transposes sum the
    # cotangents over the axes an operand was replicated on (a weight's over the batch axes).
    axes = tuple(sorted(varying_axes(x) | varying_axes(w)))
    x, w = varying_over(x, axes), varying_over(w, axes)
    if shared is None:
        return _matmul(recipe, saved)(x, w)
    if shared.recipe != recipe or shared.bits.shape != x.shape:
        raise ValueError(f"fp8_matmul: a shared input of recipe {shared.recipe!r} and shape {shared.bits.shape} for a "
                         f"{recipe!r} matmul of an input of shape {x.shape}")  # fmt: skip
    return _matmul(recipe, None, True)(x, w, varying_over(shared.bits, axes), varying_over(shared.scale, axes))


def scaled_dot(
    a: tuple[Array, Float[Array, "..."]], b: tuple[Array, Float[Array, "..."]]
) -> Float[Array, "*E T N"]:
    """Two tensorwise-quantized operands' product: an FP8 x FP8 dot accumulated in float32, times
    both scales (the form XLA's GPU compiler rewrites to a scaled FP8 cuBLASLt GEMM)."""
    (qa, sa), (qb, sb) = a, b
    return _dot(qa, qb) * (sa * sb)


def _quantized(a: Float[Array, "*E T K"], recipe: str, role: str) -> tuple[Array, Float[Array, "..."]]:
    """Operand ``role`` of a ``[*E, T, K] @ [*E, K, N]`` matmul (:func:`_blocks`) in ``recipe``'s
    FP8 and its scales. Tensorwise on a mesh: the whole tensor's scale, its largest magnitude
    over the devices holding its parts (rows over the batch axes, columns over tensor), so a mesh
    quantizes as one device does. Not over the pipeline (other stages hold other layers and
    micro-batches), nor with leading batch dims (per-expert scales: an expert axis splits
    experts, not one tensor)."""
    lead = a.ndim - 2
    block, dtype = _blocks(recipe, lead)[role]
    over = tuple(sorted(varying_axes(a) - {PIPELINE})) if recipe == "tensorwise" and lead == 0 else ()
    return quantize(a, dtype, block, power_of_two=recipe == "mxfp8", over=over)


def block_dot(
    a: tuple[Array, Array], a_block: tuple[int, ...], b: tuple[Array, Array], b_block: tuple[int, ...], recipe: str,
    *, a_t: bool = False, b_t: bool = False,
) -> Float[Array, "*E T N"]:
    """``A @ B`` in float32 of two block-quantized operands (codes and scales, their blocks as
    :func:`quantize`'s): ``A`` is ``a`` (``[*E, T, K]``; transposed if ``a_t``) and ``B`` is ``b``
    (``[*E, K, N]``; transposed if ``b_t``), each dequantized. MXFP8 on CUDA (blocks of 32 along
    ``K``, which 32 divides) is XLA's block-scaled FP8 dot instead (``jax.nn.scaled_matmul``: the
    codes and their E8M0 scales, which XLA's GPU compiler gives cuDNN's block-scaled GEMM where the
    GPU has one): the same products, summed in another order. (DeepSeek-V3's blockwise scales are
    float32, which that dot does not take.)"""

    def dequantized(qa, sa, qb, sb):
        da, db = dequantize(qa, sa, a_block), dequantize(qb, sb, b_block)
        return _dot(_mT(da) if a_t else da, _mT(db) if b_t else db)

    contracted = (a_block[-2] if a_t else a_block[-1], b_block[-1] if b_t else b_block[-2])
    k = a[0].shape[-2 if a_t else -1]
    if recipe != "mxfp8" or k % MX_BLOCK or contracted != (MX_BLOCK, MX_BLOCK):
        return dequantized(*a, *b)

    def block_scaled(qa, sa, qb, sb):  # lhs [B, T, K] and rhs [B, N, K], their scales along K
        lhs, rhs = (((_mT(q), _mT(s)) if t else (q, s)) for q, s, t in ((qa, sa, a_t), (qb, sb, not b_t)))
        lead = lhs[0].shape[:-2]
        flat = lambda x: x.reshape(-1, *x.shape[-2:])  # noqa: E731
        out = jax.nn.scaled_matmul(flat(lhs[0]), flat(rhs[0]), flat(lhs[1]).astype(E8M0), flat(rhs[1]).astype(E8M0),
                                   preferred_element_type=jnp.float32)  # fmt: skip
        # Inside shard_map its result is typed as varying over no mesh axis; the product varies
        # over its operands' axes (as the default branch's does, which the cond's types must match).
        vary = tuple(sorted(frozenset().union(*map(varying_axes, (qa, sa, qb, sb))) - varying_axes(out)))
        out = jax.lax.pcast(out, vary, to="varying") if vary else out
        return out.reshape(*lead, *out.shape[-2:])

    return jax.lax.platform_dependent(*a, *b, cuda=block_scaled, default=dequantized)


def _product(recipe: str, x: Float[Array, "*E T K"], w: Float[Array, "*E K N"], kept: tuple[Array, Array]
             ) -> Float[Array, "*E T N"]:  # fmt: skip
    """``x @ w`` in float32 as ``recipe`` computes it; ``kept``: ``x`` quantized for the weight
    gradient (role ``x_t``), which the forward product reuses where its blocks are the same."""
    blocks = _blocks(recipe, x.ndim - 2)
    if recipe == "tensorwise":
        return scaled_dot(kept, _quantized(w, recipe, "w"))
    x_q = kept if blocks["x"] == blocks["x_t"] else _quantized(x, recipe, "x")
    return block_dot(x_q, blocks["x"][0], _quantized(w, recipe, "w"), blocks["w"][0], recipe)


def _input_grad(recipe: str, g: Float[Array, "*E T N"], w: Float[Array, "*E K N"]) -> Float[Array, "*E T K"]:
    """``g @ wᵀ`` in float32 as ``recipe`` computes the input's gradient."""
    if recipe == "tensorwise":
        q_w, s_w = _quantized(w, recipe, "w_t")
        return scaled_dot(_quantized(g, recipe, "g"), (_mT(q_w), _mT(s_w)))
    blocks = _blocks(recipe, w.ndim - 2)
    return block_dot(_quantized(g, recipe, "g"), blocks["g"][0], _quantized(w, recipe, "w_t"), blocks["w_t"][0], recipe,
                     b_t=True)  # fmt: skip


def _weight_grad(recipe: str, kept: tuple[Array, Array], g: Float[Array, "*E T N"]) -> Float[Array, "*E K N"]:
    """``xᵀ @ g`` in float32 as ``recipe`` computes the weight's gradient, ``x`` as ``kept``."""
    q_xt, s_xt = kept
    if recipe == "tensorwise":
        return scaled_dot((_mT(q_xt), _mT(s_xt)), _quantized(g, recipe, "g_t"))
    blocks = _blocks(recipe, g.ndim - 2)
    return block_dot(kept, blocks["x_t"][0], _quantized(g, recipe, "g_t"), blocks["g_t"][0], recipe, a_t=True)


def batched_product(x: Float[Array, "*E T K"], w: Float[Array, "*E K N"], recipe: str) -> Float[Array, "*E T N"]:
    """``x @ w`` in float32 as ``recipe`` computes it, for model code that writes its own
    backward pass (the capacity kernel's routed experts): with leading batch dims, one scale
    per leading index (an expert's)."""
    return _product(recipe, x, w, _quantized(x, recipe, "x_t"))


def batched_input_grad(g: Float[Array, "*E T N"], w: Float[Array, "*E K N"], recipe: str) -> Float[Array, "*E T K"]:
    """``g @ wᵀ``, the gradient of :func:`batched_product`'s ``x`` for its output's cotangent ``g``."""
    return _input_grad(recipe, g, w)


def batched_weight_grad(x: Float[Array, "*E T K"], g: Float[Array, "*E T N"], recipe: str) -> Float[Array, "*E K N"]:
    """``xᵀ @ g``, the gradient of :func:`batched_product`'s ``w`` for its output's cotangent ``g``."""
    return _weight_grad(recipe, _quantized(x, recipe, "x_t"), g)


@functools.cache
def _matmul(recipe: str, saved: str | None = None, given: bool = False):
    """The custom-VJP matmul of ``recipe`` whose kept FP8 operand is named ``saved`` (one per
    pair, so traces reuse it); ``given``: that operand is made outside and given as two more
    arguments, its bits and scales (:func:`shared_input`), which get no gradient.

    Tensorwise runs its three products as FP8 dots in the program (scales applied to the float32
    result); MXFP8 and blockwise scale within the contracted dimension, which a plain dot cannot
    express, so they multiply the dequantized operands in float32, but for MXFP8 on CUDA: XLA's
    block-scaled FP8 dot (:func:`block_dot`)."""

    def forward(x, w, kept=None):
        kept = _quantized(x, recipe, "x_t") if kept is None else kept  # the weight gradient's operand, in FP8
        return _product(recipe, x, w, kept).astype(x.dtype), kept

    @jax.custom_vjp
    def f(x, w):
        return forward(x, w)[0]

    def fwd(x, w):
        out, (q_xt, s_xt) = forward(x, w)
        # Kept as its bits: jax.checkpoint rounds every floating residual to its format with
        # reduce_precision(exponent 4, mantissa 3), which for E4M3FN is IEEE's E4M3 (largest
        # finite 240), so magnitudes from 256 to 448 became inf and then NaN.
        kept = (jax.lax.bitcast_convert_type(q_xt, jnp.uint8), s_xt)
        if saved is not None:  # named here, where jax.checkpoint's policy sees the residual
            kept = tuple(checkpoint_name(a, saved) for a in kept)
        return out, (kept, w, jnp.zeros((0,), x.dtype))

    def bwd(res, g):
        (bits, s_xt), w, like = res
        q_xt = jax.lax.bitcast_convert_type(bits, _blocks(recipe, w.ndim - 2)["x_t"][1])
        dx, dw = _input_grad(recipe, g, w), _weight_grad(recipe, (q_xt, s_xt), g)
        return dx.astype(like.dtype), dw.astype(w.dtype)

    if not given:
        f.defvjp(fwd, bwd)
        return f

    def from_bits(bits, scale, lead):
        return jax.lax.bitcast_convert_type(bits, _blocks(recipe, lead)["x_t"][1]), scale

    @jax.custom_vjp
    def g(x, w, bits, scale):
        return forward(x, w, from_bits(bits, scale, x.ndim - 2))[0]

    def g_fwd(x, w, bits, scale):
        out, _ = forward(x, w, from_bits(bits, scale, x.ndim - 2))
        return out, ((bits, scale), w, jnp.zeros((0,), x.dtype))

    def g_bwd(res, cot):
        (bits, scale), _, _ = res
        dx, dw = bwd(res, cot)
        return dx, dw, np.zeros(bits.shape, jax.dtypes.float0), jnp.zeros_like(scale)

    g.defvjp(g_fwd, g_bwd)
    return g


def shared_input(names: Sequence[str], spec: str, x: Float[Array, "..."], *, saved: str | None = None) -> SharedInput | None:
    """``x``'s FP8 copy for the weight gradients of the matmuls ``names``, each ``spec``'s
    (``x`` its first operand), quantized once for them all where the active map gives them one
    FP8 recipe (else ``None``: each does as it says). ``saved``: ``x``'s placement name, given
    where these matmuls are ``x``'s only readers in the backward pass: a map that keeps or
    offloads ``x`` then keeps or offloads this one copy (a byte per element) instead."""
    recipes = {recipe_of(n) for n in names}
    if len(recipes) != 1 or recipes == {"none"}:
        return None
    (recipe,) = recipes
    xs, _ = _lhs_matrix(spec, jax.lax.stop_gradient(x))  # no gradient: the matmuls give x's
    codes, scale = _quantized(xs, recipe, "x_t")
    # As its bits (see _matmul's fwd: jax.checkpoint would round an FP8 residual as IEEE E4M3).
    kept = jax.lax.bitcast_convert_type(codes, jnp.uint8), scale
    if saved is not None:
        kept = tuple(checkpoint_name(a, saved) for a in kept)
    return SharedInput(*kept, recipe)


def matmul(
    name: str, spec: str, x: Float[Array, "..."], w: Float[Array, "..."], *, saved: str | None = None,
    shared: SharedInput | None = None,
) -> Float[Array, "..."]:
    """``jnp.einsum(spec, x, w)``, in FP8 where the active precision map says so for ``name``.

    ``spec`` is a two-operand einsum with an explicit output (``"bsd,dhk->bshk"``): the letters in
    both operands and the output are batch (experts), those in both operands only are contracted.
    ``saved``: ``x``'s placement name, given where this matmul is ``x``'s only reader in the
    backward pass (see :func:`fp8_matmul`): the map then keeps ``x``'s FP8 copy, not ``x``.
    ``shared``: that copy made once for several matmuls reading ``x`` (:func:`shared_input`).
    """
    recipe = recipe_of(name)
    shared = shared if shared is not None and shared.recipe == recipe else None
    deferred = deferred_gather(w)  # inside the step: w stands in for a layer weight gather_layer left to us
    if deferred is not None and recipe in GATHERED_RECIPES and not einsum_letters(spec)[3]:
        y = gathered_einsum(spec, x, *deferred, saved=saved, shared=shared, recipe=recipe)
    else:
        w = w if deferred is None else named(GATHERED, gather_fsdp, *deferred)
        y = jnp.einsum(spec, x, w) if recipe == "none" else einsum_fp8(spec, x, w, recipe, saved=saved, shared=shared)
    term = products.term_for(name)  # a wrapper's own term (LoRA dropout's path: zoo.hooks.products)
    return y if term is None else y + term(spec, x, w)


def einsum_letters(spec: str) -> tuple[str, str, str, list[str], list[str], list[str], list[str]]:
    """A two-operand einsum's operands and output, and its batch, contracted and free letters."""
    inputs, _, out = spec.replace(" ", "").partition("->")
    lhs, _, rhs = inputs.partition(",")
    if not out or not rhs or "," in rhs or "." in spec:
        raise ValueError(f"einsum_fp8 takes 'lhs,rhs->out' with explicit letters, got {spec!r}")
    batch = [c for c in lhs if c in rhs and c in out]
    contract = [c for c in lhs if c in rhs and c not in out]
    lfree = [c for c in lhs if c not in rhs]
    rfree = [c for c in rhs if c not in lhs]
    if sorted(out) != sorted(batch + lfree + rfree):
        raise ValueError(f"einsum_fp8: output {out!r} of {spec!r} is not a matmul's (no sums over one operand alone)")
    return lhs, rhs, out, batch, contract, lfree, rfree


def _lhs_matrix(spec: str, x: Float[Array, "..."]) -> tuple[Float[Array, "*E T K"], int]:
    """``spec``'s first operand ``x`` as the ``[*E, T, K]`` operand of its batched matmul, and
    the number of leading batch dims."""
    lhs, _, _, batch, contract, lfree, _ = einsum_letters(spec)
    size = dict(zip(lhs, x.shape, strict=True))
    xs = jnp.transpose(x, [lhs.index(c) for c in batch + lfree + contract])
    e = (math.prod(size[c] for c in batch),) if batch else ()
    return xs.reshape(*e, math.prod(size[c] for c in lfree), math.prod(size[c] for c in contract)), len(e)


def einsum_fp8(
    spec: str, x: Float[Array, "..."], w: Float[Array, "..."], recipe: str, *, saved: str | None = None,
    shared: SharedInput | None = None,
) -> Float[Array, "..."]:
    """A two-operand einsum as one batched ``[E, T, K] @ [E, K, N]`` FP8 matmul of ``recipe``."""
    lhs, rhs, out, batch, contract, lfree, rfree = einsum_letters(spec)
    size = dict(zip(lhs, x.shape, strict=True)) | dict(zip(rhs, w.shape, strict=True))

    def prod(letters):
        return math.prod(size[c] for c in letters)

    xs, _ = _lhs_matrix(spec, x)
    ws = jnp.transpose(w, [rhs.index(c) for c in batch + contract + rfree])
    e = (prod(batch),) if batch else ()
    y = fp8_matmul(xs, ws.reshape(*e, prod(contract), prod(rfree)), recipe, saved=saved, shared=shared)
    y = y.reshape([size[c] for c in batch + lfree + rfree])
    order = batch + lfree + rfree
    return jnp.transpose(y, [order.index(c) for c in out])


# -- FSDP: a tensorwise or blockwise weight gathered as its FP8 codes ----------------------------

# Recipes whose weight quantization serves the forward product and the input's gradient alike (one
# scale, or square blocks), so a layer weight is gathered once, as its codes: not MXFP8's (blocks
# of 32 along each product's own contracted dimension, two quantizations of the weight).
GATHERED_RECIPES = ("tensorwise", "blockwise")


def gathered_einsum(
    spec: str, x: Float[Array, "..."], w: Float[Array, "..."], dims: Sequence[Gather], *, saved: str | None = None,
    shared: SharedInput | None = None, recipe: str = "tensorwise",
) -> Float[Array, "..."]:
    """``einsum(spec, x, gather_fsdp(w, dims))`` in ``recipe`` (tensorwise or blockwise), ``w`` a
    device's block of a layer weight (inside the parallel step) whose gather moves its FP8 codes.

    Tensorwise: the whole weight's scale is its largest magnitude over every device holding a
    part (a ``pmax`` of a scalar). Blockwise: each 128x128 block's scale of the gathered weight's
    ``[K, N]`` matrix is its largest magnitude over the devices holding its parts (a ``pmax`` of
    the ``[K/128, N/128]`` grid, over the gather's axes: a device's block of the weight need not
    be whole blocks). Either way each device quantizes its block exactly as the gathered weight
    would be quantized: the codes are the same, and the gather moves a byte an element instead of
    the compute dtype's two (float32's four). The product, its input gradient and the weight
    gradient (reduce-scattered back to the block, in ``w``'s dtype) are :func:`fp8_matmul`'s, bit
    for bit in the forward pass. The backward pass gathers the codes again, as the remat policy
    re-gathers any layer weight (:data:`zoo.hooks.step.GATHERED`)."""
    lhs, rhs, out, batch, contract, lfree, rfree = einsum_letters(spec)
    if batch:
        raise ValueError(f"gathered_einsum: {spec!r} has batch letters {batch} (per-expert scales); gather the weight first")
    size = dict(zip(lhs, x.shape, strict=True)) | dict(zip(rhs, gathered_shape(w, dims), strict=True))
    xs, _ = _lhs_matrix(spec, x)
    # As fp8_matmul casts the gathered weight and the input, each to the axes either varies over
    # (the gathered weight is invariant over the gather's shared axes).
    invariant = {a for g in dims for a in g.shared}
    axes = tuple(sorted(varying_axes(xs) | (varying_axes(w) - invariant)))
    xs, w = varying_over(xs, axes), varying_over(w, tuple(a for a in axes if a not in invariant))
    if recipe == "tensorwise":  # every device holding a part of the weight (tensor-split ones too)
        over = tuple(sorted((varying_axes(w) | {a for g in dims for a in g.axes}) - {PIPELINE}))
    else:  # the gather's: a tensor-split weight's devices each multiply their own [K, N] matrix
        over = tuple(sorted({a for g in dims for a in g.axes}))
    perm = tuple(rhs.index(c) for c in contract + rfree)
    kn = (math.prod(size[c] for c in contract), math.prod(size[c] for c in rfree))
    f = _gathered_matmul(recipe, tuple(dims), perm, len(contract), kn, over, saved, shared is not None)
    if shared is None:
        y = f(xs, w)
    else:
        if shared.bits.shape != xs.shape:
            raise ValueError(f"gathered_einsum: a shared input of shape {shared.bits.shape} for an input of shape {xs.shape}")
        y = f(xs, w, varying_over(shared.bits, axes), varying_over(shared.scale, axes))
    order = lfree + rfree
    return jnp.transpose(y.reshape([size[c] for c in order]), [order.index(c) for c in out])


def _block_of_each(w: Float[Array, "..."], dims: tuple[Gather, ...], perm: tuple[int, ...], nk: int,
                   kn: tuple[int, int]) -> tuple[Array, Array]:  # fmt: skip
    """For each element of ``w`` (a device's block of a weight gathered on ``dims``), the row and
    column of its 128x128 block in the gathered weight's ``[K, N]`` matrix (its dims ``perm``, the
    first ``nk`` of them contracted), broadcastable to ``w``'s shape."""
    shape = list(w.shape)
    full = list(shape)
    coords = [jax.lax.broadcasted_iota(jnp.int32, [n if i == d else 1 for i, n in enumerate(shape)], d)
              for d in range(w.ndim)]  # fmt: skip
    for g in dims:  # where this device's block starts: its index over the gather's axes, outermost first
        full[g.dim] = gathered_shape(w, (g,))[g.dim]
        coords[g.dim] = coords[g.dim] + jax.lax.axis_index(g.axes) * shape[g.dim]

    def flat(ds):  # row-major index over dims ds of the gathered weight
        index = jnp.zeros((), jnp.int32)
        for d in ds:
            index = index * full[d] + coords[d]
        return index

    rows, cols = flat(perm[:nk]), flat(perm[nk:])
    assert math.prod(full[d] for d in perm[:nk]) == kn[0] and math.prod(full[d] for d in perm[nk:]) == kn[1]
    return rows // TILE, cols // TILE


@functools.cache
def _gathered_matmul(recipe: str, dims: tuple[Gather, ...], perm: tuple[int, ...], nk: int, kn: tuple[int, int],
                     over: tuple[str, ...], saved: str | None, given: bool):  # fmt: skip
    """:func:`gathered_einsum`'s custom-VJP product of ``[T, K]`` rows and a weight block whose
    dims ``perm`` lays out, once gathered, as ``kn`` (the first ``nk`` of them contracted);
    ``given``: ``x``'s FP8 copy is made outside (:func:`shared_input`) and given as two more arguments."""
    blocks = _blocks(recipe, 0)

    def weight(w):  # the gathered weight's codes (as bits, in w's layout) and scales (of its [K, N] matrix)
        a = jnp.abs(w.astype(jnp.float32))
        if recipe == "tensorwise":
            amax = jnp.max(a)
            scale = scale_of(jax.lax.pmax(amax, over) if over else amax, E4M3)
            each, scale = scale, scale.reshape(1, 1)
        else:  # each element's 128x128 block of the gathered matrix; the grid's maxima over the devices
            r, c = _block_of_each(w, dims, perm, nk, kn)
            grid = jnp.zeros((-(-kn[0] // TILE), -(-kn[1] // TILE)), jnp.float32)
            amax = grid.at[jnp.broadcast_to(r, w.shape), jnp.broadcast_to(c, w.shape)].max(a)
            scale = scale_of(jax.lax.pmax(amax, over) if over else amax, E4M3)
            each = scale[r, c]
        bits = jax.lax.bitcast_convert_type(codes(w, each, E4M3), jnp.uint8)
        return named(GATHERED, gather_fsdp, bits, dims), scale

    def as_matrix(bits):
        return jnp.transpose(jax.lax.bitcast_convert_type(bits, E4M3), perm).reshape(kn)

    def product(x, kept, q_w):  # _product's, the weight's codes given
        if recipe == "tensorwise":
            return scaled_dot(kept, q_w)
        return block_dot(_quantized(x, recipe, "x"), blocks["x"][0], q_w, blocks["w"][0], recipe)

    def forward(x, w, kept):
        kept = _quantized(x, recipe, "x_t") if kept is None else kept
        bits, s_w = weight(w)
        return product(x, kept, (as_matrix(bits), s_w)).astype(x.dtype), kept, bits, s_w

    def residuals(x, w, kept_bits, s_xt, bits, s_w):
        if saved is not None and not given:  # named where jax.checkpoint's policy sees it (see _matmul)
            kept_bits, s_xt = checkpoint_name(kept_bits, saved), checkpoint_name(s_xt, saved)
        return (kept_bits, s_xt), bits, s_w, w, jnp.zeros((0,), x.dtype)

    def bwd(res, g):
        (kept_bits, s_xt), bits, s_w, w, like = res
        q_w = as_matrix(bits)
        if recipe == "tensorwise":
            dx = scaled_dot(_quantized(g, recipe, "g"), (_mT(q_w), _mT(s_w)))
        else:  # _input_grad's: the weight's blocks as the forward product's (square)
            dx = block_dot(_quantized(g, recipe, "g"), blocks["g"][0], (q_w, s_w), blocks["w_t"][0], recipe, b_t=True)
        dw = _weight_grad(recipe, (jax.lax.bitcast_convert_type(kept_bits, E4M3), s_xt), g)
        dw = jnp.transpose(dw.reshape([bits.shape[i] for i in perm]), np.argsort(perm)).astype(w.dtype)
        (dw,) = jax.linear_transpose(lambda v: gather_fsdp(v, dims), w)(dw)  # the gather's reduce-scatter
        return dx.astype(like.dtype), dw

    if not given:

        @jax.custom_vjp
        def f(x, w):
            return forward(x, w, None)[0]

        def f_fwd(x, w):
            out, (q_xt, s_xt), bits, s_w = forward(x, w, None)
            return out, residuals(x, w, jax.lax.bitcast_convert_type(q_xt, jnp.uint8), s_xt, bits, s_w)

        f.defvjp(f_fwd, bwd)
        return f

    @jax.custom_vjp
    def g(x, w, kept_bits, scale):
        return forward(x, w, (jax.lax.bitcast_convert_type(kept_bits, E4M3), scale))[0]

    def g_fwd(x, w, kept_bits, scale):
        out, _, bits, s_w = forward(x, w, (jax.lax.bitcast_convert_type(kept_bits, E4M3), scale))
        return out, residuals(x, w, kept_bits, scale, bits, s_w)

    def g_bwd(res, cot):
        (kept_bits, scale), *_ = res
        dx, dw = bwd(res, cot)
        return dx, dw, np.zeros(kept_bits.shape, jax.dtypes.float0), jnp.zeros_like(scale)

    g.defvjp(g_fwd, g_bwd)
    return g
