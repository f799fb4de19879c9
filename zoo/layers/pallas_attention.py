"""Causal attention through JAX's own Pallas kernels: splash attention on TPU, the Triton flash
attention on GPU. Both take packed rows' segment ids, so neither builds a dense mask.

Each kernel is compiled on its own backend and run by Pallas's interpreter anywhere else (the
same kernel code, evaluated with XLA ops: slow, but it is how the tests check these paths on a
CPU). Semantics are those of :func:`zoo.layers.attention.causal_attention`: causal, optional
``segment_ids``, query head h reading key/value head h // R, a value head size Kv <= K.

- :func:`splash_attention`: ``jax.experimental.pallas.ops.tpu.splash_attention``, the kernel
  MaxText trains with on TPU. Takes GQA and MLA's value head size as they are; applies no softmax
  scale, so the queries are scaled first. Block pairs the mask hides are skipped by the kernel's
  mask info (causal and across segments).
- :func:`pallas_gpu_attention`: ``jax.experimental.pallas.ops.gpu.attention.mha``. Needs one
  head size for q, k and v and as many key as query heads: keys and values are repeated over the
  R query heads of a group (their gradients summed back by autodiff) and values zero-padded to K.
  JAX 0.12.1 removed that module (the GPU kernels it ships are Mosaic GPU's now):
  :func:`gpu_kernel_available` says whether this JAX has it, and without it the path refuses.

Inside ``shard_map`` (every zoo.parallel step) the kernels run on each device's shards. JAX's
library kernels declare their outputs without the mesh axes they vary over, which
``check_vma`` rejects; :func:`_per_device` supplies them while the kernels are traced (by giving
the kernel's module a ``jax`` whose ``ShapeDtypeStruct`` declares them).

The sequence is padded to whole blocks at its end; causality keeps every real query from the
padding keys, and the padding rows are dropped. The kernels' residuals are named as the other
paths name theirs, ``"context"`` (the output) and ``"attn_lse"`` (the log-sum-exp), so a placement
map that keeps them spares the backward pass a second forward kernel.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from zoo.hooks.step import varying_over
from zoo.layers.flash_attention import _vma

# Splash attention's block (queries and keys, forward and backward). 512 is what MaxText uses on
# TPU; shorter sequences use one block of the padded length.
SPLASH_BLOCK = 512
# The Triton kernel's blocks: JAX's defaults for ``mha`` (forward 128, backward 32).
GPU_BLOCK_Q, GPU_BLOCK_BACKWARD = 128, 32


def _pad_to(x: Array | None, length: int, value=0) -> Array | None:
    """``x`` padded along axis 1 (the sequence) to ``length``."""
    if x is None or x.shape[1] == length:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad, constant_values=value)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.cache
def _splash_kernel(heads: int, length: int, block: int, interpret: bool):
    """The causal splash kernel for ``heads`` x ``length`` (its block-mask tables built once, as
    constants: built during a trace they would be that trace's values)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((length, length)) for _ in range(heads)])
    sizes = sk.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    with jax.ensure_compile_time_eval():
        return sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret)


def splash_attention(
    q: Float[Array, "B S H K"],
    k: Float[Array, "B S G K"],
    v: Float[Array, "B S G Kv"],
    *,
    scale: float,
    segment_ids: Int[Array, "B S"] | None = None,
    block: int = SPLASH_BLOCK,
    interpret: bool | None = None,
) -> Float[Array, "B S H Kv"]:
    """Splash attention (TPU; interpreted elsewhere unless ``interpret=False``)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    s, h = q.shape[1], q.shape[2]
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    # The kernel's tiles are multiples of 128 rows: the largest block up to ``block`` that pads
    # the sequence least (S = 600 runs as 5 blocks of 128, not 2 of 512).
    sizes = [b for b in (512, 256, 128) if b <= max(block, 128)]
    blk = min(sizes, key=lambda b: (_round_up(s, b), -b))
    padded = _round_up(s, blk)
    kernel = _splash_kernel(h, padded, blk, interpret)
    # The kernel applies no scale: it goes on the queries (as MaxText does), in their dtype.
    qh = _pad_to(q * jnp.asarray(scale, q.dtype), padded).transpose(0, 2, 1, 3)  # [B, H, S, K]
    kh = _pad_to(k, padded).transpose(0, 2, 1, 3)
    vh = _pad_to(v, padded).transpose(0, 2, 1, 3)
    seg = None if segment_ids is None else _pad_to(segment_ids.astype(jnp.int32), padded, value=-1)

    def run(q, k, v, seg):
        if seg is None:
            return jax.vmap(kernel)(q, k, v)
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sk.SegmentIds(q=s, kv=s)))(q, k, v, seg)

    out = _per_device(run, sk, qh, kh, vh, seg)
    return checkpoint_name(out.transpose(0, 2, 1, 3)[:, :s], "context")


TRITON_ATTENTION = "jax.experimental.pallas.ops.gpu.attention"


@functools.cache
def gpu_kernel_available() -> bool:
    """Whether this JAX ships the Triton flash attention ``pallas_gpu`` runs (removed in 0.12.1)."""
    return importlib.util.find_spec(TRITON_ATTENTION) is not None


def require_gpu_kernel() -> None:
    """Raise, naming the path and the JAX version, where ``pallas_gpu`` cannot run."""
    if not gpu_kernel_available():
        raise ValueError(
            f"attention implementation 'pallas_gpu' runs {TRITON_ATTENTION}, which jax {jax.__version__} "
            "no longer ships (removed in jax 0.12.1): use 'auto', 'cudnn' or 'blockwise', or jax < 0.12.1"
        )


def pallas_gpu_attention(
    q: Float[Array, "B S H K"],
    k: Float[Array, "B S G K"],
    v: Float[Array, "B S G Kv"],
    *,
    scale: float,
    segment_ids: Int[Array, "B S"] | None = None,
    block_q: int = GPU_BLOCK_Q,
    block_backward: int = GPU_BLOCK_BACKWARD,
    interpret: bool | None = None,
) -> Float[Array, "B S H Kv"]:
    """JAX's Pallas (Triton) flash attention (GPU; interpreted elsewhere unless ``interpret=False``)."""
    require_gpu_kernel()
    from jax.experimental.pallas.ops.gpu import attention as triton_attention

    _, s, h, d = q.shape
    g, kv = k.shape[2], v.shape[-1]
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    # Forward and backward tiles must divide the (padded) length, which is cut into as many
    # query as key blocks for the fused backward pass.
    padded = _round_up(s, max(block_q, block_backward))
    blk = min(block_q, padded)
    sizes = triton_attention.BlockSizes(
        block_q=blk, block_k=blk, block_q_dkv=block_backward, block_kv_dkv=block_backward,
        block_q_dq=block_backward, block_kv_dq=block_backward,
    )  # fmt: skip
    if kv < d:
        v = jnp.pad(v, [(0, 0), (0, 0), (0, 0), (0, d - kv)])
    if g != h:  # the kernel reads key head h for query head h
        k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    seg = None if segment_ids is None else _pad_to(segment_ids.astype(jnp.int32), padded, value=-1)
    mha = functools.partial(triton_attention.mha, sm_scale=scale, causal=True, block_sizes=sizes, interpret=interpret)
    out = _per_device(mha, triton_attention, _pad_to(q, padded), _pad_to(k, padded), _pad_to(v, padded), seg)
    return checkpoint_name(out[:, :s, :, :kv], "context")


_declaring = threading.RLock()


class _JaxDeclaring:
    """The ``jax`` a library kernel module sees while it is traced: ``jax`` itself but for
    ``ShapeDtypeStruct``, whose declarations default to varying over the given mesh axes."""

    def __init__(self, declared: type) -> None:
        self.ShapeDtypeStruct = declared

    def __getattr__(self, name: str) -> Any:
        return getattr(jax, name)


@contextlib.contextmanager
def _outputs_varying_over(axes: frozenset, module: Any):
    """While ``module``'s kernel is traced, its ``jax.ShapeDtypeStruct`` output declarations say
    they vary over ``axes``: inside ``shard_map(check_vma=True)`` a ``pallas_call`` needs that,
    and JAX's kernels leave it unset (their callers are expected to run without the check).
    Only that module's name ``jax`` is replaced, for the trace."""
    mat = jax.sharding.ManualAxisType(varying=axes)

    class Declared(jax.ShapeDtypeStruct):
        __slots__ = ()

        def __init__(self, shape, dtype, *, manual_axis_type=None, **kw):
            super().__init__(shape, dtype, manual_axis_type=mat if manual_axis_type is None else manual_axis_type, **kw)

    with _declaring:
        module.jax, base = _JaxDeclaring(Declared), module.jax
        try:
            yield
        finally:
            module.jax = base


def _named_residuals(vjp, out):
    """The kernel's residuals, its output and log-sum-exp named ``"context"`` / ``"attn_lse"``
    (what a placement map places; the rest are its inputs' copies, cheap to recompute)."""
    rows = out.size // out.shape[-1]

    def name(x):
        if x is out:
            return checkpoint_name(x, "context")
        if x.ndim == out.ndim - 1 and x.size == rows and x.dtype == jnp.float32:
            return checkpoint_name(x, "attn_lse")
        return x

    return jax.tree.map(name, vjp)


def _per_device(kernel, module, q, k, v, segment_ids):
    """``kernel(q, k, v, segment_ids)`` (from library ``module``) on this device's shards, also
    inside ``shard_map``, with its residuals named for the placement maps."""
    axes = frozenset(_vma(q, k, v, segment_ids))
    declared = functools.partial(_outputs_varying_over, axes, module) if axes else contextlib.nullcontext

    def varying(x):  # every operand typed as varying over every axis any of them does
        return varying_over(x, sorted(axes))

    # A custom VJP, so the backward kernels are traced under the same declarations and the
    # residuals carry names. Every array is an argument (a closed-over one would escape a later
    # trace of fwd: remat, scan).
    @jax.custom_vjp
    def call(q, k, v, segment_ids):
        with declared():
            return kernel(q, k, v, segment_ids)

    def fwd(q, k, v, segment_ids):
        with declared():
            out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, segment_ids), q, k, v)
        return out, _named_residuals(vjp, out)

    def bwd(vjp, ct):
        with declared():
            return (*vjp(ct), None)

    call.defvjp(fwd, bwd)
    # pcast's transpose sums a replicated operand's gradient over the axes it is replicated on.
    return call(varying(q), varying(k), varying(v), varying(segment_ids))


KERNELS = {"splash": splash_attention, "pallas_gpu": pallas_gpu_attention}
BACKENDS = {"splash": "tpu", "pallas_gpu": "gpu"}  # where each kernel is compiled, not interpreted


@functools.cache
def warn_interpreted(path: str) -> None:
    """Once per path: a kernel forced off its backend runs in Pallas's (slow) interpreter."""
    warnings.warn(
        f"attention {path!r} is a {BACKENDS[path].upper()} kernel; on {jax.default_backend()} it runs in "
        "Pallas's interpreter (correct, slow: for tests)",
        stacklevel=3,
    )
