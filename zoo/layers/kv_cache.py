"""A generation cache of keys and values, attention over it, and running layer stacks against it.

Dimension letters: L layers · B batch · S positions fed at once · T cache slots (``max_len``) ·
G key/value heads · H query heads · K key head size · U value head size · D model width.

Cache slot ``t`` holds position ``t``; a query at position ``p`` sees the slots ``t <= p``
(:mod:`zoo.generate` explains the right-padded layout). Families with another cache (DeepSeek-V3's
compressed latent cache) keep it in their own folder and reuse :func:`write_token`,
:func:`masked_softmax` and the stack runners.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class SlotCache(eqx.Module):
    """A generation cache: every layer's entries for ``max_len`` slots of each row, and a field
    ``lengths`` (``[B]``): the tokens row ``b`` holds, which is also the position of its next token."""

    @property
    @abc.abstractmethod
    def max_len(self) -> int:
        """The slots of each row."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies over all layers: its share of every buffer but ``lengths``."""
        return bytes_per_token(self, *(a for a in jax.tree.leaves(self) if a is not self.lengths))


class KVCache(SlotCache):
    """Keys (after RoPE) and values of every layer for ``T`` positions of ``B`` rows: a token
    takes ``L · G · (K + U) · itemsize`` bytes.

    Grouped-query caches (G key/value heads), and per-head caches with a value head size U
    other than K (DeepSeek-V3's expanded reference). Heads come before positions so that a
    layer's slice is already in the layout the attention products read.
    """

    k: Float[Array, "L B G T K"]
    v: Float[Array, "L B G T U"]
    lengths: Int[Array, " B"]

    @classmethod
    def empty(cls, layers: int, batch: int, max_len: int, heads: int, k_dim: int, v_dim: int, dtype) -> KVCache:
        return cls(
            jnp.zeros((layers, batch, heads, max_len, k_dim), dtype),
            jnp.zeros((layers, batch, heads, max_len, v_dim), dtype),
            jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def filled(self, k: Float[Array, "L B S G K"], v: Float[Array, "L B S G U"], lengths: Int[Array, " B"]) -> KVCache:
        """The cache with the prompt's keys and values in slots ``0..S-1`` and ``lengths`` set."""
        k, v = (fill(buf, jnp.swapaxes(e, 2, 3)) for buf, e in ((self.k, k), (self.v, v)))
        return KVCache(k, v, lengths.astype(jnp.int32))

    def written(
        self, layer: Int[Array, ""], positions: Int[Array, " B"], k: Float[Array, "B G K"], v: Float[Array, "B G U"]
    ) -> KVCache:
        """The cache with one new token per row written at ``positions`` in ``layer``."""
        return eqx.tree_at(
            lambda c: (c.k, c.v), self, (write_token(self.k, layer, positions, k), write_token(self.v, layer, positions, v))
        )


def bytes_per_token(cache: Any, *arrays: Array | jax.ShapeDtypeStruct) -> int:
    """Bytes one token of ``cache`` occupies over all layers."""
    b, t = cache.lengths.shape[0], cache.max_len
    return sum(a.size * a.dtype.itemsize for a in arrays) // (b * t)


def fill(buffer: Float[Array, "L B *X"], entries: Float[Array, "L B *Y"]) -> Float[Array, "L B *X"]:
    """``entries`` written at the start of every axis of ``buffer`` (the prompt's slots)."""
    return jax.lax.dynamic_update_slice(buffer, entries.astype(buffer.dtype), (0,) * entries.ndim)


def visible(positions: Int[Array, "B S"], max_len: int) -> Array:
    """``[B, S, T]``: slot t holds position t; a query at position p sees t <= p."""
    return jnp.arange(max_len, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]


def masked_softmax(scores: Float[Array, "*X T"], mask: Array) -> Float[Array, "*X T"]:
    """Softmax over the last axis of the slots ``mask`` allows."""
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
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
    probs = masked_softmax(scores, visible(positions, k.shape[2])[:, None, None]).astype(v.dtype)
    ctx = jnp.einsum("bgrst,bgtu->bsgru", probs, v)
    return ctx.reshape(b, s, h, v.shape[-1])


def write_token(buffer: Float[Array, "L B *X"], layer: Int[Array, ""], positions: Int[Array, " B"], rows: Array) -> Array:
    """Write one token per row into slot ``positions[b]`` of layer ``layer``: ``rows`` is
    ``[B, F]`` for a per-token cache (``L B T F``), ``[B, G, K]`` for a per-head one (``L B G T K``)."""
    b = positions.shape[0]
    if buffer.ndim == 5:  # heads before positions: the indexed axes are not adjacent, B leads
        return buffer.at[layer, jnp.arange(b), :, positions].set(rows.astype(buffer.dtype))
    return buffer.at[layer, jnp.arange(b), positions].set(rows.astype(buffer.dtype))


Stack = tuple[Any, Any]  # (stacked layers, what kind of layer: passed back to the body)


def prefill_stacks(
    x: Float[Array, "B S D"], stacks: Sequence[Stack], body: Callable[[Array, Any, Any], tuple[Array, Any]]
) -> tuple[Float[Array, "B S D"], Any]:
    """``body(h, layer, kind) -> (h, entries)`` scanned over each stack in order; the entries
    (what the cache keeps) come back stacked over all layers, ``[L, ...]``."""
    out = []
    for layers, kind in stacks:
        x, entries = jax.lax.scan(lambda h, layer, kind=kind: body(h, layer, kind), x, layers)
        out.append(entries)
    return x, jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *out)


def decode_stacks(
    x: Float[Array, "B 1 D"],
    cache: Any,
    stacks: Sequence[Stack],
    body: Callable[[Array, Any, Any, Int[Array, ""], Any], tuple[Array, Any]],
) -> tuple[Float[Array, "B 1 D"], Any]:
    """``body(h, cache, layer, index, kind) -> (h, cache)`` scanned over each stack in order,
    ``index`` the layer's place in the whole model (its cache slice)."""
    first = 0
    for layers, kind in stacks:
        n = jax.tree.leaves(layers)[0].shape[0]

        def step(carry, xs, kind=kind):
            return body(*carry, *xs, kind), None

        (x, cache), _ = jax.lax.scan(step, (x, cache), (layers, jnp.arange(first, first + n, dtype=jnp.int32)))
        first += n
    return x, cache


def last_token(x: Float[Array, "B S D"], lengths: Int[Array, " B"]) -> Float[Array, "B 1 D"]:
    """Each row's hidden state at its last real token (``lengths[b] - 1``)."""
    return jnp.take_along_axis(x, (lengths - 1).astype(jnp.int32)[:, None, None], axis=1)


def check_prefill(input_ids: Int[Array, "B S"], max_len: int) -> None:
    if input_ids.shape[1] > max_len:
        raise ValueError(f"prefill: the prompts are {input_ids.shape[1]} positions wide but the cache has max_len={max_len}")


def check_cache_size(batch: int, max_len: int) -> None:
    if batch < 1 or max_len < 1:
        raise ValueError(f"init_cache needs batch >= 1 and max_len >= 1, got batch={batch}, max_len={max_len}")


def no_options(model: Any, options: dict[str, Any]) -> None:
    """A family whose cache takes no options refuses any, naming them."""
    if options:
        raise ValueError(
            f"{type(model).__name__} takes no cache options, got {', '.join(f'{k}={v!r}' for k, v in options.items())}"
        )
