"""Running a stack of identical layers with ``jax.lax.scan`` (compile time independent of depth)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax

from zoo.core.params import with_values
from zoo.hooks import products
from zoo.hooks.pipeline import pipelined_scan
from zoo.hooks.step import GATHERED, pipeline_of, remat_policy

Carry = TypeVar("Carry")
LAYER_SCOPE = "decoder_layer"  # the named scope of every scanned layer's ops (zoo.train.trace_report reads it)
_POLICY: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar("zoo_layer_policy", default=None)


def layer_policy_now() -> Callable[..., Any] | None:
    """The remat policy of the layer body being traced (:func:`scan_layers`'s, after
    :func:`zoo.hooks.remat_policy`), for a loop inside the layer that checkpoints its own
    iterations as the layer does (``None``: outside a layer body, or no policy)."""
    return _POLICY.get()


@contextlib.contextmanager
def _policy(policy: Callable[..., Any] | None) -> Iterator[None]:
    token = _POLICY.set(policy)
    try:
        yield
    finally:
        _POLICY.reset(token)


def checkpoint_layer(fn: Callable[..., Any], policy: Callable[..., Any] | None) -> Callable[..., Any]:
    """``fn`` checkpointed as :func:`scan_layers` checkpoints a layer's body, for one layer run
    outside a stack (DeepSeek-V3's MTP block): under the map's ``policy`` after
    :func:`zoo.hooks.remat_policy` (inside zoo.parallel's step FSDP re-gathers instead of
    saving, with or without a map), announced to the loops inside it
    (:func:`layer_policy_now`)."""
    policy = remat_policy(policy)

    def announced(*args: Any) -> Any:
        with _policy(policy):
            return fn(*args)

    return announced if policy is None else jax.checkpoint(announced, policy=policy, prevent_cse=False)


def scan_layers(
    body: Callable[..., tuple[Carry, Any]],
    carry: Carry,
    stacked: Any,
    *,
    policy: Callable[..., Any] | None = None,
    rows: Any = None,
    combine: Any = None,
    pipeline: tuple[Any, int] | None = None,
) -> tuple[Carry, Any]:
    """``body(carry, layer) -> (carry, out)`` for each layer slice of ``stacked`` (leading axis L);
    with ``rows``, ``body(carry, layer, rows)``.

    ``policy``: a ``jax.checkpoint`` policy for the layer body (from a placement map), or
    ``None`` to keep every intermediate on device. Returns the last carry and the stacked outs.
    ``rows``: the per-row inputs every layer reads (RoPE tables, segment ids), each leading
    with the batch rows like the carry: inside a step that pipelines this stack
    (:mod:`zoo.pipeline`) they are cut into micro-batches with it, which a value the body
    closes over could not be.
    ``combine``: how each per-layer output combines over those micro-batches (a prefix of
    ``out``: ``"sum"``, ``"mean"`` or ``"rows"``; default: integers summed, floats averaged;
    :func:`zoo.pipeline.pipelined_scan`). Without pipelining it is not used.
    ``pipeline``: for a ``stacked`` that is a view of stored stacks (reshaped, or several in a
    dict), what :func:`zoo.hooks.pipeline_of` says of those stacks with the view's real length
    (``None``: ``pipeline_of(stacked)``).
    The body runs under ``jax.named_scope(LAYER_SCOPE)``: its ops' names carry it, so a profile
    (XProf, Nsight Systems, ``recipes/profile.py``) shows the layers' forward and backward as
    such (one scope for every layer: the scan compiles one body for all of them).
    """
    mapped = policy is not None
    policy = remat_policy(policy)  # inside zoo.parallel's step: FSDP re-gathers instead of saving

    def under(checkpointed: Callable[..., Any] | None) -> Callable[..., tuple[Carry, Any]]:
        def scoped(c: Carry, layer: Any, r: Any) -> tuple[Carry, Any]:  # announces the policy it runs under
            # (a wrapper's terms for this layer's products, added as its weights are computed:
            # zoo.hooks.products)
            with jax.named_scope(LAYER_SCOPE), _policy(checkpointed), products.scope():
                layer = with_values(layer)  # a deferred weight's value: this layer's only
                return body(c, layer) if rows is None else body(c, layer, r)

        return scoped

    scoped = under(policy)
    fn = scoped if policy is None else jax.checkpoint(scoped, policy=policy, prevent_cse=False)
    if (pipelined := pipeline if pipeline is not None else pipeline_of(stacked)) is not None:
        keep = policy if mapped else _named_only

        def picked(c: Carry, at: tuple[Any, Any], r: Any) -> tuple[Carry, Any]:
            block, i = at
            layer = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), block)
            return under(keep)(c, layer, r)

        # The interleaved schedule runs, at each tick, the layers of a chunk the tick picks. Picked
        # outside the checkpoint, each tick's weights were a residual of the tick loop: the whole
        # stage's weights saved once per micro-batch. Picked inside, the residual is the stage's
        # block (loop-invariant: kept once) and the index; the pick is redone in the backward
        # pass. Without a map, every named tensor is kept (the `device` preset): keeping every
        # value would keep what the weights become (cast, transposed) at every tick.
        return pipelined_scan(fn, carry, stacked, rows, *pipelined, combine=combine,
                              pick=jax.checkpoint(picked, policy=keep, prevent_cse=False))  # fmt: skip
    return jax.lax.scan(lambda c, layer: fn(c, layer, rows), carry, stacked)


def _named_only(prim: Any, *avals: Any, **params: Any) -> bool:
    """Save every named tensor but FSDP's gathered weights; recompute the rest."""
    return prim.name == "name" and params.get("name") != GATHERED
