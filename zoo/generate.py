"""Generation: prefill and decode over a preallocated cache, sampling, a jitted loop.

Dimension letters (the model files' where they are the same):
    B batch · S prompt positions (right-padded) · T cache slots (``max_len``) · O new tokens
    L layers · H query heads · G key/value heads · K key head size · U value head size
    C kv latent (``kv_lora_rank``) · P rope key size (``qk_rope_head_dim``) · N no-rope key
    size (``qk_nope_head_dim``) · D model width · V vocabulary · R rotary frequencies

Prompts of different lengths are **right-padded**: row ``b`` holds its ``lengths[b]`` tokens
in slots ``0 .. lengths[b]-1``, so every token sits at its own position and RoPE is what the
unpadded forward pass computes. Cache slot ``t`` holds position ``t``; a query at position
``p`` sees the slots ``t <= p``. Padding written by the prefill is never seen: it lies after
the row's last real token, and a decoded token overwrites slot ``lengths[b]`` before it is
read.

Caches:

- :class:`KVCache` (Llama): keys after RoPE and values, ``2·G·K`` numbers per token per layer.
- :class:`MLACache` (DeepSeek-V3): only the normalised kv latent and the rotated rope key,
  ``C + P`` numbers per token per layer, shared by all heads. Decoding absorbs the key half
  of ``kv_b_proj`` into the query (``q_nope · W_k`` lands in the latent space), attends over
  the latent cache directly, and applies the value half once to the attended latent: keys
  and values are never expanded for the context.
- ``mla="expanded"`` gives DeepSeek-V3 an ordinary per-head :class:`KVCache`
  (``H·(K + U)`` numbers) and ``mla="reexpand"`` an :class:`MLACache` re-expanded for the
  whole context every step (what MaxText and jax-llm-examples do); both are references
  for the tests and the benchmark.

The prefill runs the model's ordinary (expanded) attention over the prompt: for S queries
at once, attention over the latent would cost ``S²·H·(2C + P)`` against ``S²·H·(K + U)``
expanded (3x more for DeepSeek-V3's C=512, K=192, U=128), while expanding the prompt's
latent costs only ``S·C·H·(N + U)``. Decoding one token is the opposite case: expansion
would cost ``T·C·H·(N + U)`` per step, absorption ``H·N·C + H·C·U``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo.deepseek_v3.config import DeepseekV3Config
from zoo.deepseek_v3.model import MLA, DeepseekV3, dense_layer_ffn, mla_expand, mla_project, moe_layer_ffn
from zoo.layers import causal_attention, embed, rms_norm, rope_cos_sin, unembed
from zoo.llama.model import Llama, llama_post_attention, llama_qkv

MLADecode = Literal["absorbed", "reexpand", "expanded"]
MLA_DECODES: tuple[str, ...] = ("absorbed", "reexpand", "expanded")
Model = Llama | DeepseekV3


class KVCache(eqx.Module):
    """Keys (after RoPE) and values of every layer for ``T`` positions of ``B`` rows.

    Llama's grouped-query cache (G key/value heads); DeepSeek-V3's expanded reference cache
    (G = H, and a value head size U that differs from K). Heads come before positions so
    that a layer's slice is already in the layout the attention products read.
    ``lengths[b]``: the tokens row ``b`` holds, which is also the position of its next token.
    """

    k: Float[Array, "L B G T K"]
    v: Float[Array, "L B G T U"]
    lengths: Int[Array, " B"]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies over all layers: ``L · G · (K + U) · itemsize``."""
        return _bytes_per_token(self, self.k, self.v)


class MLACache(eqx.Module):
    """DeepSeek-V3's compressed cache: per token and layer, the normalised kv latent (C)
    and the rotated rope key (P), shared by every head. ``absorb``: decode by weight
    absorption (``False``: re-expand keys and values for the whole context every step)."""

    latent: Float[Array, "L B T C"]
    k_rope: Float[Array, "L B T P"]
    lengths: Int[Array, " B"]
    absorb: bool = eqx.field(static=True, default=True)

    @property
    def max_len(self) -> int:
        return self.latent.shape[2]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies over all layers: ``L · (C + P) · itemsize``."""
        return _bytes_per_token(self, self.latent, self.k_rope)


Cache = KVCache | MLACache


def _bytes_per_token(cache: KVCache | MLACache, *arrays: Array | jax.ShapeDtypeStruct) -> int:
    b, t = cache.lengths.shape[0], cache.max_len
    return sum(a.size * a.dtype.itemsize for a in arrays) // (b * t)


def _check_model(model: object, mla: str) -> None:
    if not isinstance(model, (Llama, DeepseekV3)):
        raise TypeError(f"zoo.generate supports Llama and DeepseekV3 models, got {type(model).__name__}")
    if mla not in MLA_DECODES:
        raise ValueError(f"mla must be one of {MLA_DECODES}, got {mla!r}")
    if isinstance(model, Llama) and mla != "absorbed":
        raise ValueError(f"mla={mla!r} applies to DeepSeek-V3 (multi-head latent attention), not to Llama")


def init_cache(model: Model, batch: int, max_len: int, *, mla: MLADecode = "absorbed") -> Cache:
    """An empty cache of ``max_len`` positions for ``batch`` rows, in the model's compute dtype."""
    _check_model(model, mla)
    config, dtype = model.config, model.compute_dtype
    if batch < 1 or max_len < 1:
        raise ValueError(f"init_cache needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}")
    lengths = jnp.zeros((batch,), jnp.int32)
    layers = config.num_layers
    if isinstance(model, Llama):
        shape = (layers, batch, config.num_kv_heads, max_len, config.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths)
    if mla == "expanded":
        heads = (layers, batch, config.num_heads, max_len)
        return KVCache(
            jnp.zeros((*heads, config.qk_head_dim), dtype), jnp.zeros((*heads, config.v_head_dim), dtype), lengths
        )
    return MLACache(
        jnp.zeros((layers, batch, max_len, config.kv_lora_rank), dtype),
        jnp.zeros((layers, batch, max_len, config.qk_rope_head_dim), dtype),
        lengths,
        absorb=mla == "absorbed",
    )


# -- attention over a cache ---------------------------------------------------------------


def _visible(positions: Int[Array, "B S"], max_len: int) -> Array:
    """``[B, S, T]``: slot t holds position t; a query at position p sees t <= p."""
    return jnp.arange(max_len, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]


def _softmax(scores: Float[Array, "*X T"], visible: Array) -> Float[Array, "*X T"]:
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


def cached_attention(
    q: Float[Array, "B S H K"],
    k: Float[Array, "B G T K"],
    v: Float[Array, "B G T U"],
    positions: Int[Array, "B S"],
    *,
    scale: float,
) -> Float[Array, "B S H U"]:
    """Grouped-query attention of queries at ``positions`` over a cache's slots (query head
    h reads key head h // (H/G)); scores and softmax in float32."""
    b, s, h, kd = q.shape
    g = k.shape[1]
    qg = q.reshape(b, s, g, h // g, kd)
    scores = jnp.einsum("bsgrk,bgtk->bgrst", qg, k, preferred_element_type=jnp.float32) * scale
    probs = _softmax(scores, _visible(positions, k.shape[2])[:, None, None]).astype(v.dtype)
    ctx = jnp.einsum("bgrst,bgtu->bsgru", probs, v)
    return ctx.reshape(b, s, h, v.shape[-1])


def absorbed_attention(
    config: DeepseekV3Config,
    p: MLA,
    q: Float[Array, "B S H K"],
    latent: Float[Array, "B T C"],
    k_rope: Float[Array, "B T P"],
    positions: Int[Array, "B S"],
) -> Float[Array, "B S H U"]:
    """MLA attention over the compressed cache by weight absorption.

    With ``W_k = wkv_b[..., :N]`` and ``W_v = wkv_b[..., N:]`` (``C H N`` / ``C H U``), the
    expanded path's score ``q_nope · (latent W_k) + q_rope · k_rope`` equals
    ``(q_nope W_kᵀ) · latent + q_rope · k_rope``, and its context ``Σ_t p_t (latent_t W_v)``
    equals ``(Σ_t p_t latent_t) W_v``: queries move into the latent space once per token,
    every head reads the same ``C + P`` numbers per cached token (multi-query attention
    over the latent), and ``W_v`` is applied once to the attended latent.
    """
    n = config.qk_nope_head_dim
    w_k, w_v = p.wkv_b[..., :n], p.wkv_b[..., n:]
    q_latent = jnp.einsum("bshn,chn->bshc", q[..., :n], w_k)
    scores = jnp.einsum("bshc,btc->bhst", q_latent, latent, preferred_element_type=jnp.float32)
    scores = scores + jnp.einsum("bshp,btp->bhst", q[..., n:], k_rope, preferred_element_type=jnp.float32)
    probs = _softmax(scores * config.softmax_scale, _visible(positions, latent.shape[1])[:, None])
    ctx_latent = jnp.einsum("bhst,btc->bshc", probs.astype(latent.dtype), latent)
    return jnp.einsum("bshc,chu->bshu", ctx_latent, w_v)


def _write(buffer: Float[Array, "L B *X"], layer: Int[Array, ""], positions: Int[Array, " B"], rows: Array) -> Array:
    """Write one token per row into slot ``positions[b]`` of layer ``layer``: ``rows`` is
    ``[B, F]`` for an MLA cache (``L B T F``), ``[B, G, K]`` for a key/value cache (``L B G T K``)."""
    b = positions.shape[0]
    if buffer.ndim == 5:  # heads before positions: the indexed axes are not adjacent, B leads
        return buffer.at[layer, jnp.arange(b), :, positions].set(rows.astype(buffer.dtype))
    return buffer.at[layer, jnp.arange(b), positions].set(rows.astype(buffer.dtype))


def _heads_first(x: Float[Array, "B T H K"]) -> Float[Array, "B H T K"]:
    return jnp.swapaxes(x, 1, 2)


def _mla_decode(
    config: DeepseekV3Config,
    p: MLA,
    h: Float[Array, "B 1 D"],
    cos: Float[Array, "B 1 R"],
    sin: Float[Array, "B 1 R"],
    cache: Cache,
    i: Int[Array, ""],
    positions: Int[Array, "B 1"],
) -> tuple[Float[Array, "B 1 D"], Cache]:
    """One layer's attention for one new token per row; returns its output and the cache."""
    q, latent, k_rope = mla_project(config, p, h, cos, sin)
    pos = positions[:, 0]
    if isinstance(cache, KVCache):  # expanded: expand the new token only, cache per-head keys and values
        k, v = mla_expand(config, p, latent, k_rope)
        ks, vs = _write(cache.k, i, pos, k[:, 0]), _write(cache.v, i, pos, v[:, 0])
        ctx = cached_attention(q, ks[i], vs[i], positions, scale=config.softmax_scale)
        cache = eqx.tree_at(lambda c: (c.k, c.v), cache, (ks, vs))
    else:
        lat, kr = _write(cache.latent, i, pos, latent[:, 0]), _write(cache.k_rope, i, pos, k_rope[:, 0])
        if cache.absorb:
            ctx = absorbed_attention(config, p, q, lat[i], kr[i], positions)
        else:  # re-expand keys and values for every cached position (the reference)
            k, v = mla_expand(config, p, lat[i], kr[i])
            ctx = cached_attention(q, _heads_first(k), _heads_first(v), positions, scale=config.softmax_scale)
        cache = eqx.tree_at(lambda c: (c.latent, c.k_rope), cache, (lat, kr))
    return jnp.einsum("bshu,hud->bsd", ctx, p.wo), cache


# -- prefill and decode --------------------------------------------------------------------


def _head(model: Model, x: Float[Array, "B S D"]) -> Float[Array, "B S V"]:
    x = rms_norm(x, model.final_norm, model.config.rms_norm_eps)
    return unembed(x, model.embed if model.head is None else model.head)


def _cast(model: Model, layer, moe: bool):
    if moe:
        return DeepseekV3._cast_moe(layer, model.compute_dtype)
    return jax.tree.map(lambda w: w.astype(model.compute_dtype), layer)


def _stacks(model: Model) -> list[tuple[object, int, bool]]:
    """The layer stacks of a model: (stacked layers, first layer index, is MoE)."""
    if isinstance(model, Llama):
        return [(model.layers, 0, False)]
    out = []
    if model.dense_layers is not None:
        out.append((model.dense_layers, 0, False))
    if model.moe_layers is not None:
        out.append((model.moe_layers, model.config.num_dense_layers, True))
    return out


def _rope(model: Model, positions: Int[Array, "B S"]) -> tuple[Float[Array, "B S R"], Float[Array, "B S R"]]:
    config = model.config
    dim = config.head_dim if isinstance(model, Llama) else config.qk_rope_head_dim
    return rope_cos_sin(config.rope, dim, positions)


def prefill(
    model: Model,
    input_ids: Int[Array, "B S"],
    lengths: Int[Array, " B"],
    *,
    max_len: int,
    mla: MLADecode = "absorbed",
    all_logits: bool = False,
) -> tuple[Float[Array, "B V"] | Float[Array, "B S V"], Cache]:
    """Run right-padded prompts (row b: ``lengths[b]`` tokens, then padding) through the
    model and fill a fresh cache of ``max_len`` slots with their keys and values (the
    latent and rope key for DeepSeek-V3's compressed cache).

    Returns float32 logits at each row's last prompt token (``all_logits``: at every
    position, those after ``lengths[b]`` being padding's) and the cache, ``lengths`` set.
    """
    _check_model(model, mla)
    b, s = input_ids.shape
    if s > max_len:
        raise ValueError(f"prefill: the prompts are {s} positions wide but the cache has max_len={max_len}")
    config, dtype = model.config, model.compute_dtype
    cache = init_cache(model, b, max_len, mla=mla)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    cos, sin = _rope(model, positions)
    x = embed(model.embed, input_ids, dtype)
    entries = []
    for layers, _, moe in _stacks(model):

        def body(h, layer, moe=moe):
            layer = _cast(model, layer, moe)
            if isinstance(model, Llama):
                q, k, v = llama_qkv(config, layer, h, cos, sin)
                ctx = causal_attention(q, k, v, scale=config.head_dim**-0.5)
                return llama_post_attention(config, layer, h, ctx), (k, v)
            a = layer.attn
            q, latent, k_rope = mla_project(config, a, rms_norm(h, layer.attn_norm, config.rms_norm_eps), cos, sin)
            k, v = mla_expand(config, a, latent, k_rope)
            ctx = causal_attention(q, k, v, scale=config.softmax_scale)
            h = h + jnp.einsum("bshu,hud->bsd", ctx, a.wo)
            h = moe_layer_ffn(config, layer, h, model.expert_impl)[0] if moe else dense_layer_ffn(config, layer, h)
            return h, ((k, v) if mla == "expanded" else (latent, k_rope))

        x, stored = jax.lax.scan(body, x, layers)
        entries.append(stored)
    stored = jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *entries)
    names = ("k", "v") if isinstance(cache, KVCache) else ("latent", "k_rope")
    if isinstance(cache, KVCache):  # [L, B, S, G, K] -> heads before positions
        stored = tuple(jnp.swapaxes(e, 2, 3) for e in stored)
    full = tuple(
        jax.lax.dynamic_update_slice(getattr(cache, n), e.astype(dtype), (0,) * e.ndim) for n, e in zip(names, stored)
    )
    cache = eqx.tree_at(
        lambda c: (*(getattr(c, n) for n in names), c.lengths), cache, (*full, lengths.astype(jnp.int32))
    )
    if all_logits:
        return _head(model, x), cache
    last = jnp.take_along_axis(x, (lengths - 1).astype(jnp.int32)[:, None, None], axis=1)
    return _head(model, last)[:, 0], cache


def decode_step(model: Model, cache: Cache, tokens: Int[Array, " B"]) -> tuple[Float[Array, "B V"], Cache]:
    """Feed one token per row at position ``cache.lengths[b]``: returns the float32 logits
    for the next token and the cache with that token added (``lengths + 1``).

    The caller keeps ``cache.lengths < cache.max_len`` (:func:`generate` and :func:`stream`
    size the cache so); a token past the last slot would not be stored."""
    _check_model(model, "absorbed")
    if isinstance(model, Llama) and not isinstance(cache, KVCache):
        raise TypeError(f"a Llama model decodes with a KVCache, got {type(cache).__name__}")
    config, dtype = model.config, model.compute_dtype
    positions = cache.lengths[:, None]
    cos, sin = _rope(model, positions)
    x = embed(model.embed, tokens[:, None], dtype)
    for layers, first, moe in _stacks(model):
        n_layers = jax.tree.leaves(layers)[0].shape[0]

        def body(carry, xs, moe=moe):
            h, cache = carry
            layer, i = xs
            layer = _cast(model, layer, moe)
            if isinstance(model, Llama):
                q, k, v = llama_qkv(config, layer, h, cos, sin)
                ks, vs = _write(cache.k, i, positions[:, 0], k[:, 0]), _write(cache.v, i, positions[:, 0], v[:, 0])
                ctx = cached_attention(q, ks[i], vs[i], positions, scale=config.head_dim**-0.5)
                cache = eqx.tree_at(lambda c: (c.k, c.v), cache, (ks, vs))
                return (llama_post_attention(config, layer, h, ctx), cache), None
            a = rms_norm(h, layer.attn_norm, config.rms_norm_eps)
            out, cache = _mla_decode(config, layer.attn, a, cos, sin, cache, i, positions)
            h = h + out
            h = moe_layer_ffn(config, layer, h, model.expert_impl)[0] if moe else dense_layer_ffn(config, layer, h)
            return (h, cache), None

        index = jnp.arange(first, first + n_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (layers, index))
    cache = eqx.tree_at(lambda c: c.lengths, cache, cache.lengths + 1)
    return _head(model, x)[:, 0], cache


# -- sampling ------------------------------------------------------------------------------


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Refuse settings that mean nothing, naming them."""
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and 0 <= temperature < np.inf):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


class Sampling(eqx.Module):
    """Sampling settings as arrays, so one compiled program serves every setting."""

    temperature: Float[Array, ""]
    top_k: Int[Array, ""]
    top_p: Float[Array, ""]

    @classmethod
    def of(cls, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None) -> Sampling:
        """Checked settings; ``top_k=None`` keeps every token, ``top_p=None`` all the mass."""
        check_sampling(temperature, top_k, top_p)
        big = np.iinfo(np.int32).max
        return cls(jnp.float32(temperature), jnp.int32(big if top_k is None else top_k), jnp.float32(top_p or 1.0))


def sample(
    logits: Float[Array, "B V"],
    key: PRNGKeyArray | None,
    *,
    temperature: float | Float[Array, ""] = 0.0,
    top_k: int | Int[Array, ""] | None = None,
    top_p: float | Float[Array, ""] | None = None,
) -> Int[Array, " B"]:
    """One token per row. ``temperature == 0``: greedy (argmax; ``key`` unused). Otherwise
    the logits are divided by ``temperature``, cut to the ``top_k`` largest, then to the
    smallest set of the largest whose probability (renormalised after the top-k cut)
    reaches ``top_p`` (``transformers``' order), and sampled with ``key``. Ties with the
    last token kept are kept. The settings may be Python numbers (checked) or traced arrays."""
    if not any(isinstance(v, jax.Array) for v in (temperature, top_k, top_p)):
        settings = Sampling.of(temperature, top_k, top_p)
        if temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if key is None:
            raise ValueError(f"sampling with temperature={temperature} needs a PRNG key (key=jax.random.key(0))")
    else:
        settings = Sampling(
            jnp.asarray(temperature, jnp.float32),
            jnp.asarray(np.iinfo(np.int32).max if top_k is None else top_k, jnp.int32),
            jnp.asarray(1.0 if top_p is None else top_p, jnp.float32),
        )
        key = jr.key(0) if key is None else key
    logits = logits.astype(jnp.float32)

    def draw() -> Int[Array, " B"]:
        scaled = logits / jnp.maximum(settings.temperature, jnp.finfo(jnp.float32).tiny)
        floor = jnp.finfo(jnp.float32).min
        desc = -jnp.sort(-scaled, axis=-1)
        rank = jnp.arange(scaled.shape[-1], dtype=jnp.int32)
        in_top_k = rank < settings.top_k
        probs = jax.nn.softmax(jnp.where(in_top_k, desc, floor), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the larger tokens
        keep = in_top_k & ((before < settings.top_p) | (rank == 0))
        threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        return jr.categorical(key, jnp.where(scaled < threshold, floor, scaled), axis=-1).astype(jnp.int32)

    return jax.lax.cond(settings.temperature > 0, draw, lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))


# -- the loop --------------------------------------------------------------------------------


class Generation(NamedTuple):
    """What :func:`generate` returns."""

    tokens: Int[Array, "B O"]
    """New tokens per row; after a row's end-of-sequence token (kept), ``pad_id``."""
    num_tokens: Int[Array, " B"]
    """How many tokens each row generated, its end-of-sequence token included."""


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Int[Array, "B S"], Int[Array, " B"]]:
    """Right-pad token lists into ``[B, S]`` ids and their ``[B]`` lengths."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(f"every prompt needs at least one token; got lengths {[len(p) for p in prompts]}")
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int32)
    for row, p in zip(ids, prompts):
        row[: len(p)] = p
    return jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32)


def eos_token_ids(source: str | Path | Model | int | Sequence[int] | None) -> tuple[int, ...]:
    """End-of-sequence ids: from a checkpoint directory's ``generation_config.json`` (else its
    ``config.json``), from a model's config, or given (an int or a list); ``None``: none."""
    if isinstance(source, (Llama, DeepseekV3)):
        source = source.config.eos_token_id
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_dir():
            raise ValueError(f"{path}: not a checkpoint directory (looking for generation_config.json)")
        for name in ("generation_config.json", "config.json"):
            if (path / name).is_file():
                data = json.loads((path / name).read_text())
                if data.get("eos_token_id") is not None:
                    source = data["eos_token_id"]
                    break
        else:
            source = None
    if source is None:
        return ()
    ids = (source,) if isinstance(source, int) else tuple(source)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"end-of-sequence token ids must be non-negative integers, got {source!r}")
    return ids


def _plan(model: Model, input_ids, lengths, max_new_tokens: int) -> tuple[np.ndarray, int]:
    """Check the request against the model; returns the lengths and the cache size."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, positions], got shape {tuple(input_ids.shape)}")
    b, s = input_ids.shape
    lengths = np.full((b,), s, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if lengths.shape != (b,):
        raise ValueError(f"lengths must have one entry per row ({b}), got shape {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > s:
        raise ValueError(f"lengths must be in 1..{s} (the padded prompt width), got {lengths.tolist()}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    limit = model.config.max_position_embeddings
    longest = int(lengths.max())
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt length {longest} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} tokens exceeds "
            f"the model's max_position_embeddings {limit}"
        )
    return lengths, s + max_new_tokens - 1


def _key(key: PRNGKeyArray | None, temperature: float) -> PRNGKeyArray:
    if key is None:
        if temperature > 0:
            raise ValueError(f"sampling with temperature={temperature} needs a PRNG key (key=jax.random.key(0))")
        return jr.key(0)
    return key


@eqx.filter_jit
def _generate(model, input_ids, lengths, key, eos_ids, sampling: Sampling, pad_id, max_len, max_new_tokens, mla):
    b = input_ids.shape[0]
    logits, cache = prefill(model, input_ids, lengths, max_len=max_len, mla=mla)
    first = sample(logits, jr.fold_in(key, 0), **_kw(sampling))
    tokens = jnp.full((b, max_new_tokens), pad_id).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids)

    def cond(state):
        i, _, _, _, done, _ = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, last, cache, tokens, done, count = state
        logits, cache = decode_step(model, cache, last)
        token = jnp.where(done, pad_id, sample(logits, jr.fold_in(key, i), **_kw(sampling)))
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.isin(token, eos_ids)
        return i + 1, token, cache, tokens.at[:, i].set(token), done, count

    state = (jnp.int32(1), first, cache, tokens, done, jnp.ones((b,), jnp.int32))
    _, _, _, tokens, _, count = jax.lax.while_loop(cond, body, state)
    return Generation(tokens, count)


def generate(
    model: Model,
    input_ids: Int[Array, "B S"],
    lengths: Int[Array, " B"] | Sequence[int] | None = None,
    *,
    max_new_tokens: int,
    key: PRNGKeyArray | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    mla: MLADecode = "absorbed",
) -> Generation:
    """Generate up to ``max_new_tokens`` per row in one compiled program (prefill, then a
    ``while_loop`` of decode steps that ends early once every row has stopped).

    ``input_ids``: right-padded prompts, ``lengths`` tokens each (all ``S`` when ``None``;
    see :func:`pad_prompts`). Sampling: see :func:`sample`; step ``i`` samples with
    ``jax.random.fold_in(key, i)``. A row stops after an ``eos_token_id`` (default: the
    model config's ``eos_token_id``; ``()`` never stops). Prompt plus new tokens must fit
    ``config.max_position_embeddings``.
    """
    _check_model(model, mla)
    sampling = Sampling.of(temperature, top_k, top_p)
    lengths, max_len = _plan(model, input_ids, lengths, max_new_tokens)
    eos = eos_token_ids(model if eos_token_id is None else eos_token_id)
    eos_ids = jnp.asarray(eos or (-1,), jnp.int32)  # -1: never sampled
    key = _key(key, temperature)
    return _generate(
        model, input_ids, jnp.asarray(lengths), key, eos_ids, sampling, jnp.int32(pad_id), max_len, max_new_tokens, mla
    )


@eqx.filter_jit
def _prefill_sample(model, input_ids, lengths, key, sampling: Sampling, max_len, mla):
    logits, cache = prefill(model, input_ids, lengths, max_len=max_len, mla=mla)
    return sample(logits, jr.fold_in(key, 0), **_kw(sampling)), cache


@eqx.filter_jit(donate="all-except-first")  # the cache is updated in place
def _decode_sample(fixed, cache, last, i, done):
    model, key, sampling, pad_id = fixed
    logits, cache = decode_step(model, cache, last)
    token = jnp.where(done, pad_id, sample(logits, jr.fold_in(key, i), **_kw(sampling)))
    return token, cache


def _kw(sampling: Sampling) -> dict[str, Array]:
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def stream(
    model: Model,
    input_ids: Int[Array, "B S"],
    lengths: Int[Array, " B"] | Sequence[int] | None = None,
    *,
    max_new_tokens: int,
    key: PRNGKeyArray | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    mla: MLADecode = "absorbed",
) -> Iterator[Int[np.ndarray, " B"]]:
    """:func:`generate`, one step at a time: yields each step's ``[B]`` tokens (``pad_id``
    for rows already stopped) as soon as they are sampled, the same tokens ``generate``
    returns. The first step is the prefill; each later one a compiled decode step."""
    _check_model(model, mla)
    sampling = Sampling.of(temperature, top_k, top_p)
    lengths, max_len = _plan(model, input_ids, lengths, max_new_tokens)
    eos = np.asarray(eos_token_ids(model if eos_token_id is None else eos_token_id), np.int32)
    key = _key(key, temperature)
    token, cache = _prefill_sample(model, input_ids, jnp.asarray(lengths), key, sampling, max_len, mla)
    done = np.zeros(len(lengths), bool)
    fixed = (model, key, sampling, jnp.int32(pad_id))
    for i in range(max_new_tokens):
        if i:
            token, cache = _decode_sample(fixed, cache, token, jnp.int32(i), jnp.asarray(done))
        host = np.array(token)  # a copy: the buffer is donated to the next step
        yield host
        done = done | np.isin(host, eos)
        if done.all():
            return
