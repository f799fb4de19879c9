"""Generation: prefill and decode over a preallocated cache, sampling, a jitted loop.

Dimension letters: B batch · S prompt positions (right-padded) · O new tokens · V vocabulary.

Prompts of different lengths are **right-padded**: row ``b`` holds its ``lengths[b]`` tokens
in slots ``0 .. lengths[b]-1``, so every token sits at its own position and RoPE is what the
unpadded forward pass computes. Cache slot ``t`` holds position ``t``; a query at position
``p`` sees the slots ``t <= p``. Padding written by the prefill is never seen: it lies after
the row's last real token, and a decoded token overwrites slot ``lengths[b]`` before it is
read.

Everything model-specific is the model's own (:class:`zoo.causal_lm.CausalLM`):
``model.init_cache``, ``model.prefill`` and ``model.decode_step``: a grouped-query
:class:`~zoo.layers.kv_cache.KVCache` (:class:`zoo.layers.gqa_decode.GQAGeneration`), or a
cache of the family's own (its ``decode.py``). A family's cache options pass through as keyword arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo.core.protocol import CausalLM, Mergeable
from zoo.layers.kv_cache import KVCache, cached_attention  # noqa: F401  (re-exported)


def _generating(model: object) -> CausalLM:
    """The model that generates: ``model``, or an adapted one's weights merged once
    (:class:`zoo.lora.LoraModel`'s ``merged()``: merging inside each decode step would repeat it)."""
    if isinstance(model, Mergeable) and not isinstance(model, CausalLM):
        model = model.merged()
    _check_model(model)
    return model


def _check_model(model: object) -> None:
    if not isinstance(model, CausalLM):
        raise TypeError(f"zoo.generate takes a zoo model (a zoo.causal_lm.CausalLM), got {type(model).__name__}")


def init_cache(model: CausalLM, batch: int, max_len: int, **cache_options: Any) -> eqx.Module:
    """An empty cache of ``max_len`` positions for ``batch`` rows, in the model's compute dtype."""
    _check_model(model)
    return model.init_cache(batch, max_len, **cache_options)


def prefill(
    model: CausalLM,
    input_ids: Int[Array, "B S"],
    lengths: Int[Array, " B"] | Sequence[int] | None = None,
    *,
    max_len: int,
    all_logits: bool = False,
    **cache_options: Any,
) -> tuple[Float[Array, "B V"] | Float[Array, "B S V"], eqx.Module]:
    """Run right-padded prompts (row b: ``lengths[b]`` tokens, then padding) through the
    model and fill a fresh cache of ``max_len`` slots. ``lengths=None``: every row is full
    (``S`` tokens), as in :func:`generate` and :func:`stream`.

    Returns float32 logits at each row's last prompt token (``all_logits``: at every
    position, those after ``lengths[b]`` being padding's) and the cache, ``lengths`` set.
    """
    _check_model(model)
    b, width = input_ids.shape
    lengths = jnp.full((b,), width, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    return model.prefill(input_ids, lengths, max_len=max_len, all_logits=all_logits, **cache_options)


def decode_step(model: CausalLM, cache: eqx.Module, tokens: Int[Array, " B"]) -> tuple[Float[Array, "B V"], eqx.Module]:
    """Feed one token per row at position ``cache.lengths[b]``: returns the float32 logits
    for the next token and the cache with that token added (``lengths + 1``).

    The caller keeps ``cache.lengths < cache.max_len`` (:func:`generate` and :func:`stream`
    size the cache so); a token past the last slot would not be stored."""
    _check_model(model)
    return model.decode_step(cache, tokens)


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


def eos_token_ids(source: str | Path | CausalLM | int | Sequence[int] | None) -> tuple[int, ...]:
    """End-of-sequence ids: from a checkpoint directory's ``generation_config.json`` (else its
    ``config.json``), from a model's config, or given (an int or a list); ``None``: none."""
    if isinstance(source, CausalLM):
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


def _plan(model: CausalLM, input_ids, lengths, max_new_tokens: int, pad_id: int | None = None) -> tuple[np.ndarray, int]:
    """Check the request against the model (every id, padding included, and ``pad_id`` within
    its vocabulary); returns the lengths and the cache size."""
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
    vocab = model.config.vocab_size
    try:
        ids = np.asarray(input_ids)
    except jax.errors.TracerArrayConversionError:  # traced: the model call checks what it can
        ids = None
    if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        row, col = np.argwhere((ids < 0) | (ids >= vocab))[0].tolist()
        raise ValueError(f"input_ids[{row}, {col}] = {int(ids[row, col])} is outside the model's vocabulary "
                         f"0..{vocab - 1} (padding too: pad_prompts's pad_id must be a token id)")  # fmt: skip
    if pad_id is not None and not 0 <= int(pad_id) < vocab:
        raise ValueError(f"pad_id {pad_id} is outside the model's vocabulary 0..{vocab - 1}")
    limit = model.config.max_position_embeddings
    longest = int(lengths.max())
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt length {longest} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} tokens exceeds "
            f"the model's max_position_embeddings {limit}"
        )
    return lengths, s + max_new_tokens - 1


def _cache_options(model: CausalLM, options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The options checked now (the model's ``init_cache`` refuses what it does not take) and
    made hashable: they are static arguments of the compiled loop."""
    jax.eval_shape(lambda: model.init_cache(1, 1, **options))
    return tuple(sorted(options.items()))


def _key(key: PRNGKeyArray | None, temperature: float) -> PRNGKeyArray:
    if key is None:
        if temperature > 0:
            raise ValueError(f"sampling with temperature={temperature} needs a PRNG key (key=jax.random.key(0))")
        return jr.key(0)
    return key


@eqx.filter_jit
def _generate(model, input_ids, lengths, key, eos_ids, sampling: Sampling, pad_id, max_len, max_new_tokens, options):
    b = input_ids.shape[0]
    logits, cache = model.prefill(input_ids, lengths, max_len=max_len, **dict(options))
    first = sample(logits, jr.fold_in(key, 0), **_kw(sampling))
    tokens = jnp.full((b, max_new_tokens), pad_id).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids)

    def cond(state):
        i, _, _, _, done, _ = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, last, cache, tokens, done, count = state
        logits, cache = model.decode_step(cache, last)
        token = jnp.where(done, pad_id, sample(logits, jr.fold_in(key, i), **_kw(sampling)))
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.isin(token, eos_ids)
        return i + 1, token, cache, tokens.at[:, i].set(token), done, count

    state = (jnp.int32(1), first, cache, tokens, done, jnp.ones((b,), jnp.int32))
    _, _, _, tokens, _, count = jax.lax.while_loop(cond, body, state)
    return Generation(tokens, count)


def generate(
    model: CausalLM | Mergeable,
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
    **cache_options: Any,
) -> Generation:
    """Generate up to ``max_new_tokens`` per row in one compiled program (prefill, then a
    ``while_loop`` of decode steps that ends early once every row has stopped).

    ``input_ids``: right-padded prompts, ``lengths`` tokens each (all ``S`` when ``None``;
    see :func:`pad_prompts`). Sampling: see :func:`sample`; step ``i`` samples with
    ``jax.random.fold_in(key, i)``. A row stops after an ``eos_token_id`` (default: the
    model config's ``eos_token_id``; ``()`` never stops). Prompt plus new tokens must fit
    ``config.max_position_embeddings``. ``cache_options`` go to ``model.init_cache``. A model
    with LoRA adapters (:class:`zoo.lora.LoraModel`) generates with them merged.
    """
    model = _generating(model)
    options = _cache_options(model, cache_options)
    sampling = Sampling.of(temperature, top_k, top_p)
    lengths, max_len = _plan(model, input_ids, lengths, max_new_tokens, pad_id)
    eos = eos_token_ids(model if eos_token_id is None else eos_token_id)
    eos_ids = jnp.asarray(eos or (-1,), jnp.int32)  # -1: never sampled
    key = _key(key, temperature)
    return _generate(
        model, input_ids, jnp.asarray(lengths), key, eos_ids, sampling, jnp.int32(pad_id), max_len, max_new_tokens, options
    )


@eqx.filter_jit
def _prefill_sample(model, input_ids, lengths, key, sampling: Sampling, max_len, options):
    logits, cache = model.prefill(input_ids, lengths, max_len=max_len, **dict(options))
    return sample(logits, jr.fold_in(key, 0), **_kw(sampling)), cache


@eqx.filter_jit(donate="all-except-first")  # the cache is updated in place
def _decode_sample(fixed, cache, last, i, done):
    model, key, sampling, pad_id = fixed
    logits, cache = model.decode_step(cache, last)
    token = jnp.where(done, pad_id, sample(logits, jr.fold_in(key, i), **_kw(sampling)))
    return token, cache


def _kw(sampling: Sampling) -> dict[str, Array]:
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def stream(
    model: CausalLM | Mergeable,
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
    **cache_options: Any,
) -> Iterator[Int[np.ndarray, " B"]]:
    """:func:`generate`, one step at a time: yields each step's ``[B]`` tokens (``pad_id``
    for rows already stopped) as soon as they are sampled, the same tokens ``generate``
    returns. The first step is the prefill; each later one a compiled decode step."""
    model = _generating(model)
    options = _cache_options(model, cache_options)
    sampling = Sampling.of(temperature, top_k, top_p)
    lengths, max_len = _plan(model, input_ids, lengths, max_new_tokens, pad_id)
    eos = np.asarray(eos_token_ids(model if eos_token_id is None else eos_token_id), np.int32)
    key = _key(key, temperature)
    token, cache = _prefill_sample(model, input_ids, jnp.asarray(lengths), key, sampling, max_len, options)
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
