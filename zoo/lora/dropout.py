"""LoRA dropout (PEFT's ``lora_dropout``): the adapter's input dropped while training.

PEFT computes ``W x + scale · B A drop(x)``, ``drop(x) = x · m / (1 - p)`` with a fresh
Bernoulli mask ``m`` (keep ``1 - p``) per adapted module and call. Without dropout zoo merges
``W + scale · B A`` into the weight (:mod:`zoo.lora.adapter`); with it, it runs PEFT's path:
the named product that reads the frozen weight (:attr:`zoo.core.params.Param.matmul`) adds
``scale · B A drop(x)``, a term of :mod:`zoo.hooks.products` made from the layer's ``A`` and
``B`` as the product's weight is laid out on the mesh (:func:`zoo.lora.adapter.factors`).

Dropout runs only where a step gives a key (:func:`dropout_key`; ``zoo.train`` does, from the
run's seed, the step and the micro-batch): evaluation and generation see no dropout, as PEFT's
``eval()``. Each adapted weight draws from its own key (the step's, folded with its path and its
layer), and inside the parallel step with each mesh axis its input varies over, so devices
holding other tokens (or other features) draw other masks, and devices holding the same
input (a tensor-parallel group's) draw the same.

Letters: ``r`` the adapter's rank; the product's own letters as its einsum spec names them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import zlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray, UInt32

from zoo.core.params import Param
from zoo.errors import ConfigError
from zoo.hooks.pipeline import microbatch
from zoo.hooks.products import Term
from zoo.hooks.step import varying_axes
from zoo.layers.fp8 import einsum_letters

_KEY: contextvars.ContextVar[PRNGKeyArray | None] = contextvars.ContextVar("zoo_lora_dropout_key", default=None)


@contextlib.contextmanager
def dropout_key(key: PRNGKeyArray | None) -> Iterator[None]:
    """Within it, an adapted model's calls drop their adapters' inputs (``LoraConfig.dropout``),
    with masks drawn from ``key``; ``None``: no dropout (as outside it)."""
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


def current_key() -> PRNGKeyArray | None:
    """The key :func:`dropout_key` gives this trace (``None``: no dropout)."""
    return _KEY.get()


def mask(key: PRNGKeyArray, shape: tuple[int, ...], rate: float) -> Bool[Array, "*shape"]:
    """Which elements dropout keeps, each with probability ``1 - rate`` (the rate rounded to a
    multiple of 2⁻¹⁶): 16 bits an element from XLA's own generator (JAX's ``rbg``), compared
    as integers, so no float32 draw the size of the input is made."""
    data = jr.key_data(key)
    bits = jr.bits(jr.wrap_key_data(jnp.concatenate([data, data[::-1]]), impl="rbg"), shape, jnp.uint16)
    return bits >= jnp.uint16(min(round(rate * 2**16), 2**16 - 1))


def weight_key(key: PRNGKeyArray, path: str) -> PRNGKeyArray:
    """The key of one adapted weight's masks (the step's, folded with the weight's path)."""
    return jr.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def layer_keys(key: PRNGKeyArray, path: str, layers: int) -> UInt32[Array, "L 2"]:
    """Per layer of a stacked weight, its key's raw data (sliced by the layer scan with the weight)."""
    return jr.key_data(jr.split(weight_key(key, path), layers))


# A weight's shape on this device -> its adapter's ``B`` ``[*o, r]`` and ``A`` ``[r, *i]``, each
# feature letter a dimension, the blocks that weight's block needs (zoo.lora.adapter.factors).
Factors = Callable[[tuple[int, ...]], tuple[Float[Array, "*o r"], Float[Array, "r *i"]]]


def term(path: str, p: Param, factors: Factors, scale: float, rate: float, key: PRNGKeyArray) -> Term:
    """The adapter of weight ``path`` (``p``) as a term of the product that reads it (the frozen
    weight), for one layer's adapter (its ``factors``), in the product's own letters:
    ``scale · B A drop(x)``, PEFT's path."""
    out_group, in_group = p.hf_groups()
    inner = [a for a in p.names if a not in p.stacked]

    def add(spec: str, x: Float[Array, "..."], w: Float[Array, "..."]) -> Float[Array, "..."]:
        lhs, rhs, out, _, contract, _, _ = einsum_letters(spec)
        if len(rhs) != len(inner) or w.ndim != len(inner):
            raise ConfigError(f"LoRA dropout on {path}: its product {p.matmul!r} ({spec}) reads a weight of "
                              f"{w.ndim} dimensions, not the parameter's {' '.join(inner)}")  # fmt: skip
        letter = dict(zip(inner, rhs))
        if sorted(letter[a] for a in in_group) != sorted(contract):
            raise ConfigError(f"LoRA dropout on {path}: its product {p.matmul!r} ({spec}) does not contract the "
                              f"weight's input features {' '.join(in_group)}")  # fmt: skip
        b, a = factors(w.shape)
        r = next(c for c in "rRzZyY" if c not in spec)
        ins, outs = "".join(letter[a] for a in in_group), "".join(letter[a] for a in out_group)
        rest = "".join(c for c in lhs if c not in contract)

        def low_rank(x, a, b):
            u = jnp.einsum(f"{lhs},{r}{ins}->{rest}{r}", x, a.astype(x.dtype))
            return jnp.einsum(f"{rest}{r},{outs}{r}->{out}", u, b.astype(x.dtype))

        k = key
        for axis in sorted(varying_axes(x)):  # other inputs on other devices: other masks
            k = jr.fold_in(k, jax.lax.axis_index(axis))
        if (mb := microbatch()) is not None:  # a pipeline stage's micro-batches: one weight, other masks
            k = jr.fold_in(k, mb)

        # Recomputed in the backward pass from x (which the product keeps) and the mask (a
        # byte an element): kept, the dropped x would be x's size again.
        @functools.partial(jax.checkpoint, prevent_cse=False)
        def dropped(x, a, b, keep):
            return low_rank(jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype)), a, b)

        y = dropped(x, a, b, mask(k, x.shape, rate))
        return y * jnp.asarray(scale, y.dtype)

    return add
