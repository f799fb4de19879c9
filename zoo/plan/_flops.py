"""What recomputing a named tensor costs, counted on the traced layer.

One forward trace of the model (one device's tokens, no mesh) gives each layer kind's
checkpointed body. Remat'ing a set of names makes the backward pass rerun, per layer, the
forward work that rebuilds them from what is still saved: the union of the names' *backward
slices* in the body's dataflow, cut at the saved names and the body's inputs. Its FLOPs are the
matmuls in it. The count is taken on the dense-attention, ``ragged_dot`` spelling of the layer
(the flash and grouped kernels loop a data-dependent number of times, which a trace cannot
count); attention's matmuls (those under the ``context`` scope every family's attention runs in:
scores and probabilities over [S, S]) count half, the causal mask's work. Routed experts the
precision map puts in tensorwise FP8 (which runs on the capacity kernel) are traced in that
spelling as ``ragged_dot`` products and counted as FP8 products by their scope. MXFP8
products are counted apart, as *block-scaled* FP8 products: on CUDA each is XLA's block-scaled
FP8 dot (:func:`zoo.layers.fp8.block_dot`, the ``cuda`` branch of a platform-dependent ``cond``
whose default branch is the dequantized float32 product the count reads), which runs at the FP8
peak only where the GPU has block-scaled tensor cores (``Hardware.block_scaled_fp8``); routed
experts in MXFP8 are counted so by their scope.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core

from zoo.layers import precision as zoo_precision
from zoo.layers.attention import NAMES as ATTENTION_NAMES
from zoo.layers.capacity_mlp import MATMULS as ROUTED_MATMULS
from zoo.layers.fp8 import MX_BLOCK
from zoo.lora import base_model
from zoo.placement import placement_map_for, subjaxprs
from zoo.plan.jaxprs import CALLS, call_jaxpr, jaxpr_of, later_rounds

ATTENTION_SCOPE = ATTENTION_NAMES[0]  # the named scope causal_attention runs in (zoo.layers.attention)


def _dot_flops(eqn: core.JaxprEqn, seq_len: int) -> float:
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        out = eqn.outvars[0].aval
        flops = 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lc)
        # Attention's by its scope, not by two dims of size S: a projection of a model whose width
        # is the sequence length has those too, and grouped queries fold S into a larger dim.
        if seq_len > 1 and ATTENTION_SCOPE in str(eqn.source_info.name_stack).split("/"):
            flops *= 0.5  # scores or probabilities over [S, S]: causal
        return flops
    if name in ("ragged_dot", "ragged_dot_general"):
        lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
        return 2.0 * math.prod(lhs.shape) * rhs.shape[-1]
    return 0.0


@dataclass
class _Node:
    flops: float
    ins: list[Any]
    name: str | None = None  # a checkpoint_name equation's name
    fp8: bool = False  # a product of FP8 operands (zoo.layers.fp8's tensorwise recipe)
    block: bool = False  # a block-scaled FP8 product on CUDA (MXFP8: zoo.layers.fp8.block_dot)


BLOCK_SCALED_DOT = "scaled_matmul_wrapper"  # jax.nn.scaled_matmul's primitive (XLA's __op$block_scaled_dot)


def _routed_matmul(eqn: core.JaxprEqn) -> str:
    """The routed experts' matmul a ``ragged_dot`` computes, by its scope: ``moe_gate``,
    ``moe_up``, else the down projection."""
    scopes = str(eqn.source_info.name_stack).split("/")
    return next((n for n in ROUTED_MATMULS[:2] if n in scopes), ROUTED_MATMULS[2])


def _is_fp8_dot(eqn: core.JaxprEqn, routed_fp8: frozenset[str] = frozenset()) -> bool:
    """A product of FP8 operands; or a routed experts' ``ragged_dot`` whose matmul is in ``routed_fp8``."""
    if eqn.primitive.name in ("ragged_dot", "ragged_dot_general") and routed_fp8:
        return _routed_matmul(eqn) in routed_fp8
    return eqn.primitive.name == "dot_general" and all(
        jnp.issubdtype(v.aval.dtype, jnp.floating) and jnp.dtype(v.aval.dtype).itemsize == 1 for v in eqn.invars
    )


def _is_block_scaled(eqn: core.JaxprEqn, routed_block: frozenset[str] = frozenset()) -> bool:
    """A ``cond`` chosen by platform (``jax.lax.platform_dependent``) whose CUDA branch is a
    block-scaled FP8 dot; or a routed experts' ``ragged_dot`` whose matmul is in ``routed_block``
    and whose contracted width MXFP8's blocks divide (:func:`zoo.layers.fp8.block_dot`'s rule)."""
    if eqn.primitive.name in ("ragged_dot", "ragged_dot_general") and routed_block:
        return _routed_matmul(eqn) in routed_block and eqn.invars[0].aval.shape[-1] % MX_BLOCK == 0
    if eqn.primitive.name != "cond" or not eqn.params.get("branches_platforms"):
        return False
    cuda = [b for b, p in zip(eqn.params["branches"], eqn.params["branches_platforms"]) if p and "cuda" in p]
    return any(_runs(jaxpr_of(b), BLOCK_SCALED_DOT) for b in cuda)


def _runs(jaxpr: core.Jaxpr, primitive: str) -> bool:
    """Whether ``jaxpr`` or a jaxpr inside it has an equation of ``primitive``."""
    todo = [jaxpr]
    while todo:
        j = todo.pop()
        for eqn in j.eqns:
            if eqn.primitive.name == primitive:
                return True
            todo.extend(subjaxprs(eqn))
    return False


@dataclass
class Body:
    """One checkpointed layer body: ``layers`` of them per step; its forward FLOPs per token,
    and per node what it reads, to slice."""

    layers: int
    tokens: int
    routed_fp8: frozenset[str] = frozenset()  # routed experts' matmuls in tensorwise FP8 (counted as ragged_dot)
    routed_block: frozenset[str] = frozenset()  # those in MXFP8: block-scaled FP8 products on CUDA
    nodes: list[_Node] = field(default_factory=list)
    producer: dict[int, int] = field(default_factory=dict)  # value id -> node index
    named: dict[str, list[int]] = field(default_factory=dict)  # name -> node indices
    _memo: dict[frozenset, float] = field(default_factory=dict)
    _cache: dict[str, float] = field(default_factory=dict)

    @property
    def names(self) -> set[str]:
        return set(self.named)

    def forward_flops(self) -> float:
        if "forward" not in self._cache:
            self._cache["forward"] = sum(n.flops for n in self.nodes)
        return self._cache["forward"]

    def fp8_flops(self, block: bool = False) -> float:
        """The forward FLOPs in products of FP8 operands (their gradients' products are FP8 too);
        with ``block``, the block-scaled ones too (hardware whose tensor cores run them)."""
        key = f"fp8-{block}"
        if key not in self._cache:
            self._cache[key] = float(sum(n.flops for n in self.nodes if n.fp8 or (block and n.block)))
        return self._cache[key]

    def fp8_share(self, block: bool = False) -> float:
        total = self.forward_flops()
        return self.fp8_flops(block) / total if total else 0.0

    def recompute_flops(self, remat: Iterable[str]) -> float:
        """FLOPs the backward pass reruns per layer when ``remat`` are recomputed (the other
        names saved or offloaded)."""
        remat = frozenset(remat) & self.names
        if not remat:
            return 0.0
        if remat not in self._memo:
            self._memo[remat] = self._slice_flops(remat)
        return self._memo[remat]

    def _slice_flops(self, remat: frozenset) -> float:
        seen: set[int] = set()
        stack = [i for n in remat for i in self.named[n]]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            node = self.nodes[i]
            if node.name is not None and node.name not in remat:
                continue  # saved: the slice stops here
            seen.add(i)
            stack.extend(self.producer[v] for v in node.ins if v in self.producer)
        return sum(self.nodes[i].flops for i in seen)


def _flatten(jaxpr: core.Jaxpr, env: dict[Any, int], body: Body, seq_len: int, scale: float) -> None:
    """Nodes of ``jaxpr`` into ``body``; ``env``: var -> value id. Calls inline; a scan's
    body counts ``length`` times as one node, a while loop's once."""
    for eqn in jaxpr.eqns:
        ins = [env[v] for v in eqn.invars if isinstance(v, core.Var) and v in env]
        name = eqn.primitive.name
        sub = call_jaxpr(eqn) if name in CALLS else None
        if sub is not None:
            inner = jaxpr_of(sub)
            inner_env = dict(zip(inner.invars, [env.get(v) if isinstance(v, core.Var) else None for v in eqn.invars]))
            inner_env = {k: v for k, v in inner_env.items() if v is not None}
            _flatten(inner, inner_env, body, seq_len, scale)
            for ov, iv in zip(eqn.outvars, inner.outvars):
                if isinstance(iv, core.Var) and iv in inner_env:
                    env[ov] = inner_env[iv]
            continue
        flops = _dot_flops(eqn, seq_len) * scale
        if name in ("scan", "while", "cond"):
            flops = _loop_flops(eqn, seq_len) * scale
        node = _Node(flops, ins, eqn.params["name"] if name == "name" else None, _is_fp8_dot(eqn, body.routed_fp8),
                     _is_block_scaled(eqn, body.routed_block))  # fmt: skip
        index = len(body.nodes)
        body.nodes.append(node)
        if node.name is not None:
            body.named.setdefault(node.name, []).append(index)
        for ov in eqn.outvars:
            vid = id(ov)
            env[ov] = vid
            body.producer[vid] = index


def _loop_flops(eqn: core.JaxprEqn, seq_len: int) -> float:
    name = eqn.primitive.name
    if name == "scan":
        inner = Body(1, 1)
        j = jaxpr_of(eqn.params["jaxpr"])
        _flatten(j, {v: id(v) for v in j.invars}, inner, seq_len, 1.0)
        return inner.forward_flops() * eqn.params["length"]
    if later_rounds(eqn):  # a MoE dispatch's later rounds: priced as not run
        return 0.0
    if name == "while":
        inner = Body(1, 1)
        j = jaxpr_of(eqn.params["body_jaxpr"])
        _flatten(j, {v: id(v) for v in j.invars}, inner, seq_len, 1.0)
        return inner.forward_flops()
    best = 0.0
    for b in eqn.params["branches"]:
        inner = Body(1, 1)
        j = jaxpr_of(b)
        _flatten(j, {v: id(v) for v in j.invars}, inner, seq_len, 1.0)
        best = max(best, inner.forward_flops())
    return best


def counting_model(model: Any) -> Any:
    """The model spelled for counting: dense attention, experts as ``ragged_dot`` (abstract); a
    LoRA model's base (its step is priced as the base's training)."""
    model = base_model(model)
    config = model.config
    if any(f.name == "attention" for f in dataclasses.fields(config)):
        config = dataclasses.replace(config, attention="xla")
    cls = type(model)
    kwargs: dict[str, Any] = {"compute_dtype": model.compute_dtype}
    if "expert_impl" in inspect.signature(cls.__init__).parameters:
        kwargs["expert_impl"] = "ragged_dot"
    return jax.eval_shape(lambda: cls(config, key=jax.random.key(0), **kwargs))


def fp8_share(bodies: list[Body], flops_per_sequence: float, block: bool = False) -> float:
    """The share of a sequence's training FLOPs (forward and both gradients) in FP8 products
    (with ``block``, block-scaled ones too)."""
    fp8 = sum(3 * b.fp8_flops(block) * b.layers for b in bodies)
    return min(fp8 / flops_per_sequence, 1.0) if flops_per_sequence else 0.0


def fp8_slowdown(share: float, fp8_ratio: float) -> float:
    """Compute time with ``share`` of the FLOPs at ``fp8_ratio`` times the compute dtype's peak,
    over that at the compute dtype's peak (1 without FP8 products)."""
    return 1.0 - share + share / fp8_ratio


def layer_bodies(model: Any, seq_len: int, precision: Any = None) -> list[Body]:
    """Each checkpointed body of the forward pass (one per layer kind, and a block outside the
    scans), from one trace of one sequence's loss under the all-``device`` map and the precision
    map ``precision`` (its tensorwise matmuls are FP8 products, its MXFP8 ones block-scaled FP8
    products: :meth:`Body.fp8_flops`)."""
    counting = counting_model(model)
    cls = placement_map_for(model)
    everything = cls.preset("device")
    ids = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    routed = routed_block = frozenset[str]()
    if precision is not None:  # the routed experts traced as ragged_dot in bf16, counted by their recipe
        resolved = zoo_precision.resolve(precision, counting)
        mine = [n for n in ROUTED_MATMULS if n in resolved.names()]
        routed = frozenset(n for n in mine if getattr(resolved, n) == "tensorwise")
        routed_block = frozenset(n for n in mine if getattr(resolved, n) == "mxfp8")
        precision = dataclasses.replace(resolved, **dict.fromkeys(mine, "none"))

    def loss(m: Any, x: Any) -> Any:
        with zoo_precision.using(precision, m):
            return m.loss(x, placement=everything)[0]

    jaxpr = jax.make_jaxpr(loss)(counting, ids)
    bodies: list[Body] = []

    def walk(j: Any, length: int) -> None:
        for eqn in j.eqns:
            if eqn.primitive.name in ("remat2", "checkpoint"):
                inner = jaxpr_of(eqn.params["jaxpr"])
                body = Body(length, seq_len, routed, routed_block)
                _flatten(inner, {v: id(v) for v in inner.invars}, body, seq_len, 1.0)
                if body.named:
                    bodies.append(body)
                continue
            n = eqn.params["length"] if eqn.primitive.name == "scan" else length
            for sub in subjaxprs(eqn):
                walk(sub, n)

    walk(jaxpr.jaxpr, 1)
    return bodies
