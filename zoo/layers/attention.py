"""Causal self-attention core, on whichever path runs best where it runs.

- ``"xla"``: dense einsums, ``[B, H, S, S]`` float32 scores. Fastest for short sequences on CPU.
- ``"blockwise"``: :mod:`zoo.layers.flash_attention`, the flash-attention algorithm in pure JAX
  (memory linear in S, masked blocks skipped), on every backend.
- ``"cudnn"``: cuDNN's fused kernel (``jax.nn.dot_product_attention``) on GPU in half
  precision without packed segments.
- ``"splash"`` (TPU) and ``"pallas_gpu"`` (GPU): JAX's Pallas kernels
  (:mod:`zoo.layers.pallas_attention`), both taking packed rows' segment ids. Forced on another
  backend they run in Pallas's interpreter (correct and slow: how the tests check them on CPU).

Every path names its output ``"context"`` and (all but cuDNN) the float32 log-sum-exp of each
row's scores ``"attn_lse"`` (``jax.ad_checkpoint.checkpoint_name``): the backward pass needs
both, and every family's placement map places them. The blockwise path and the Pallas kernels
name the residuals their custom VJPs keep, which is what a remat policy sees.

``"auto"`` (the default) picks, without context parallelism: splash on TPU; on GPU cuDNN where
it applies and the Pallas kernel for packed rows in half precision (where this JAX still ships
it: not from 0.12.1 on); elsewhere (CPU, float32 on
GPU) blockwise from :data:`BLOCKWISE_FROM` tokens on, else dense XLA. Under context parallelism
it runs blockwise (queries at an offset into the gathered keys, which the kernels do not take). Under context
parallelism (:mod:`zoo.hooks`: a ``"context"`` mesh axis splits the sequence) keys and values
are all-gathered over the axis and each device's queries attend at their places in the whole
sequence.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from zoo.core.named import named, region
from zoo.errors import ConfigError
from zoo.hooks.step import context_gather, context_positions, context_size
from zoo.layers import pallas_attention
from zoo.layers.flash_attention import blockwise_attention

IMPLEMENTATIONS = ("auto", "xla", "blockwise", "cudnn", "splash", "pallas_gpu")
NAMES = ("context", "attn_lse")  # checkpoint names of the output and the log-sum-exp
# From this many tokens on "auto" runs blockwise attention off cuDNN. Measured on the 2-core
# CPU (forward + backward, B=1, H=G=8, K=64, float32, CPU time): the two tie at 256 tokens,
# blockwise is 1.8x faster at 512 and 3x at 2048-4096 (and linear in memory).
BLOCKWISE_FROM = 512


def use_cudnn(dtype, masked: bool) -> bool:
    """Whether cuDNN's fused kernel can run here: on a GPU, in half precision, with no arbitrary mask."""
    return jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16) and not masked


def resolve_attention(implementation: str, dtype, seq_len: int, masked: bool) -> str:
    """The path ``causal_attention`` runs for ``implementation`` (``"auto"`` resolved)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; choose one of {IMPLEMENTATIONS}")
    if implementation == "cudnn" and not use_cudnn(dtype, masked or context_size() > 1):
        raise ValueError(
            "attention implementation 'cudnn' needs a GPU, bfloat16 or float16 inputs and no packed "
            f"segments or context parallelism (backend {jax.default_backend()}, dtype {jnp.dtype(dtype).name}, "
            f"segments {masked}, context {context_size()})"
        )
    if implementation in pallas_attention.KERNELS and context_size() > 1:
        raise ValueError(
            f"attention implementation {implementation!r} does not run under context parallelism "
            f"(context {context_size()}): use 'blockwise' or 'auto'"
        )
    if implementation == "pallas_gpu":
        pallas_attention.require_gpu_kernel()
    if implementation != "auto":
        return implementation
    if context_size() > 1:
        return "blockwise"
    backend = jax.default_backend()
    if backend == "tpu":
        return "splash"
    if use_cudnn(dtype, masked):
        return "cudnn"
    if backend == "gpu" and masked and dtype in (jnp.bfloat16, jnp.float16) and pallas_attention.gpu_kernel_available():
        # Float32 stays on the blockwise path: Triton's float32 dots may run as TF32.
        return "pallas_gpu"
    return "blockwise" if seq_len >= BLOCKWISE_FROM else "xla"


def causal_attention(
    q: Float[Array, "B S H K"],
    k: Float[Array, "B S G K"],
    v: Float[Array, "B S G Kv"],
    *,
    scale: float,
    segment_ids: Int[Array, "B S"] | None = None,
    implementation: str = "auto",
) -> Float[Array, "B S H Kv"]:
    """Softmax(q kᵀ · scale) v over earlier positions of the same segment.

    G key/value heads serve H = G·R query heads (query head h reads key head h // R).
    With ``segment_ids`` (packed sequences) no position attends across a segment boundary.
    Scores and softmax are float32 whatever the input dtype. The XLA and blockwise paths take a
    value head size other than the key's as it is (MLA's); cuDNN's needs it padded.
    """
    kv = v.shape[-1]
    if kv > k.shape[-1]:
        raise ValueError(f"value head size {kv} larger than key head size {k.shape[-1]} is unsupported")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads")
    path = resolve_attention(implementation, q.dtype, q.shape[1] * context_size(), segment_ids is not None)
    if path in pallas_attention.KERNELS and jax.default_backend() != pallas_attention.BACKENDS[path]:
        pallas_attention.warn_interpreted(path)
    # Every path names "context" inside (the kernels' custom VJPs name their residuals): the
    # scope alone goes around the path, whose backward rule runs under it too.
    with region(NAMES[0]):
        return _attention(path, q, k, v, scale, segment_ids)


def _attention(path, q, k, v, scale, segment_ids):
    """``causal_attention`` on path ``path``."""
    kv = v.shape[-1]
    if path == "cudnn":
        if kv != k.shape[-1]:
            v = jnp.pad(v, [(0, 0), (0, 0), (0, 0), (0, k.shape[-1] - kv)])
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
        return checkpoint_name(out[..., :kv], NAMES[0])
    if path in pallas_attention.KERNELS:
        return pallas_attention.KERNELS[path](q, k, v, scale=scale, segment_ids=segment_ids)
    if context_size() > 1:
        return _context_attention(q, k, v, scale, segment_ids, path)
    if path == "blockwise":
        return blockwise_attention(q, k, v, scale=scale, segment_ids=segment_ids, residual_names=NAMES)
    return dense_attention(q, k, v, scale=scale, segment_ids=segment_ids)


def _context_attention(q, k, v, scale, segment_ids, path):
    """This device's two chunks of queries against the whole sequence's keys and values."""
    k_all, v_all = context_gather(k), context_gather(v)
    seg_all = None if segment_ids is None else context_gather(segment_ids)
    q_pos = context_positions(q.shape[1])
    if path == "blockwise":
        c = q.shape[1] // 2  # two contiguous chunks of the whole sequence
        halves = [
            blockwise_attention(
                q[:, h * c : (h + 1) * c], k_all, v_all, scale=scale, q_offset=q_pos[h * c],
                segment_ids=None if segment_ids is None else segment_ids[:, h * c : (h + 1) * c],
                kv_segment_ids=seg_all, residual_names=NAMES,
            )  # fmt: skip
            for h in (0, 1)
        ]
        return jnp.concatenate(halves, axis=1)
    return dense_attention(q, k_all, v_all, scale=scale, segment_ids=segment_ids, q_positions=q_pos,
                           kv_segment_ids=seg_all)  # fmt: skip


def dense_attention(
    q: Float[Array, "B S H K"],
    k: Float[Array, "B T G K"],
    v: Float[Array, "B T G Kv"],
    *,
    scale: float,
    segment_ids: Int[Array, "B S"] | None = None,
    q_positions: Int[Array, " S"] | None = None,
    kv_segment_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, "B S H Kv"]:
    """The dense XLA path: query i (at ``q_positions[i]`` in the keys' sequence, default i)
    attends to keys at places <= its own in its segment (``kv_segment_ids``: the keys' own,
    default ``segment_ids``)."""
    b, s, h, d = q.shape
    t, g, kv = k.shape[1], k.shape[2], v.shape[-1]
    r = h // g
    # Heads-major operands, the R query heads of a group stacked along the rows ("m" = (r, s)):
    # both matmuls and their gradients are batched 2-D products over (B, G). Sequence-major
    # einsums differentiate into 5-D dots and transposes that XLA:CPU runs markedly slower
    # (benchmarks/README.md, "What profiling found and fixed").
    qm = q.reshape(b, s, g, r, d).transpose(0, 2, 3, 1, 4).reshape(b, g, r * s, d)
    kh = k.transpose(0, 2, 1, 3)
    vh = v.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bgmd,bgtd->bgmt", qm, kh, preferred_element_type=jnp.float32) * scale
    scores = scores.reshape(b, g, r, s, t)
    if q_positions is None:
        allowed = jnp.tril(jnp.ones((s, t), jnp.bool_))[None, None, None]
    else:
        allowed = (q_positions[:, None] >= jnp.arange(t, dtype=q_positions.dtype)[None, :])[None, None, None]
    if segment_ids is not None:
        k_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
        allowed = allowed & (segment_ids[:, None, None, :, None] == k_seg[:, None, None, None, :])
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    # Softmax through its log-sum-exp, named: with it saved, the backward pass recomputes the
    # probabilities without their reductions (what the blockwise path saves too).
    lse = named(NAMES[1], jax.nn.logsumexp, scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - lse).astype(v.dtype).reshape(b, g, r * s, t)
    out = jnp.einsum("bgmt,bgtv->bgmv", probs, vh)
    return checkpoint_name(out.reshape(b, g, r, s, kv).transpose(0, 3, 1, 2, 4).reshape(b, s, h, kv), NAMES[0])


def check_attention(config: Any) -> None:
    """``config.attention`` one of :data:`IMPLEMENTATIONS`, else a
    :class:`~zoo.errors.ConfigError` naming the field and the choices."""
    if config.attention not in IMPLEMENTATIONS:
        raise ConfigError(
            f"{type(config).__name__}.attention must be one of {list(IMPLEMENTATIONS)}, got {config.attention!r}"
        )
