"""Qwen3 and Qwen3-MoE: GQA with per-head RMSNorm on queries and keys, SwiGLU or softmax-routed MoE.

Dimension letters used in shapes below:
    B batch · S sequence · T tokens (B·S) · D model width · V vocabulary · H query heads
    G key/value heads · K head size · R rotary frequencies (K / 2) · F dense MLP hidden
    E routed experts · M expert hidden · Ld dense layers · Lm MoE layers

Dense and MoE layers are two stacks; the config's :attr:`~zoo.qwen3.config.Qwen3Config.blocks`
say in which order they come (``mlp_only_layers`` and ``decoder_sparse_step`` may interleave
them): one ``jax.lax.scan`` over the repeats of a pattern of layer kinds (all MoE; dense and MoE
alternating), or one per run of a kind.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo.core.layout import model_arrays
from zoo.core.mesh import PIPELINE, axis_size
from zoo.core.named import named
from zoo.core.params import Param, build, flatten
from zoo.core.protocol import options_or_default
from zoo.hooks.step import PipelineSplit, gather_layer, pipeline_of, tensor_psum
from zoo.layers import apply_rope, causal_attention, embed, rms_norm, rope_cos_sin, swiglu, unembed
from zoo.layers.decoder import DenseBlock, GQAttention, MoEBlock
from zoo.layers.embed import positions_for
from zoo.layers.fp8 import matmul, shared_input
from zoo.layers.gqa_decode import GQAGeneration, GQALayers
from zoo.layers.moe import moe_experts, resolve_expert_impl
from zoo.layers.moe_dispatch import dispatch_of
from zoo.layers.stack import scan_layers
from zoo.loss import chunked_cross_entropy, shifted_targets
from zoo.placement import layer_policy
from zoo.qwen3.checkpoint import check_layer_kinds
from zoo.qwen3.config import Qwen3Config
from zoo.qwen3.loss import Qwen3Training, RouterStats, layer_router_stats, switch_balance_loss
from zoo.qwen3.placement import Qwen3Placement
from zoo.qwen3.precision import Qwen3Precision
from zoo.qwen3.routing import Qwen3MoE, route


def qwen3_params(config: Qwen3Config) -> dict[str, Param]:
    """Every parameter of :class:`Qwen3`: layout, init and Hugging Face checkpoint key."""
    specs = {"embed": Param("V D", "model.embed_tokens.weight", "V D")}

    def block(prefix: str, stack: str, ids: tuple[int, ...]) -> None:
        index = ((stack, ids),)

        def put(path, axes, key, layout, **kw):
            specs[f"{prefix}.{path}"] = Param(f"{stack} {axes}", f"model.layers.{{{stack}}}.{key}", layout, hf_index=index, **kw)

        put("attn_norm", "D", "input_layernorm.weight", "D", init="ones")
        put("attn.wq", "D H K", "self_attn.q_proj.weight", "(H K) D", matmul="q_proj")
        put("attn.wk", "D G K", "self_attn.k_proj.weight", "(G K) D", matmul="k_proj")
        put("attn.wv", "D G K", "self_attn.v_proj.weight", "(G K) D", matmul="value")
        put("attn.wo", "H K D", "self_attn.o_proj.weight", "D (H K)", matmul="attn_out")
        put("attn.q_norm", "K", "self_attn.q_norm.weight", "K", init="ones")
        put("attn.k_norm", "K", "self_attn.k_norm.weight", "K", init="ones")
        put("mlp_norm", "D", "post_attention_layernorm.weight", "D", init="ones")
        if stack == "Ld":
            put("mlp.w_gate", "D F", "mlp.gate_proj.weight", "F D", matmul="mlp_gate")
            put("mlp.w_up", "D F", "mlp.up_proj.weight", "F D", matmul="mlp_up")
            put("mlp.w_down", "F D", "mlp.down_proj.weight", "D F", matmul="mlp_down")
        else:
            put("moe.router", "D E", "mlp.gate.weight", "E D")
            put("moe.w_gate", "E D M", "mlp.experts.{E}.gate_proj.weight", "M D")
            put("moe.w_up", "E D M", "mlp.experts.{E}.up_proj.weight", "M D")
            put("moe.w_down", "E M D", "mlp.experts.{E}.down_proj.weight", "D M")

    if config.dense_layer_ids:
        block("dense_layers", "Ld", config.dense_layer_ids)
    if config.moe_layer_ids:
        block("moe_layers", "Lm", config.moe_layer_ids)
    specs["final_norm"] = Param("D", "model.norm.weight", "D", init="ones")
    if not config.tie_word_embeddings:
        specs["head"] = Param("V D", "lm_head.weight", "V D")
    return specs


class QKNormAttention(GQAttention):
    """Grouped-query attention projections with RMSNorm over each query and key head."""

    q_norm: Float[Array, "*L K"]
    k_norm: Float[Array, "*L K"]


class DenseLayer(DenseBlock):
    attn: QKNormAttention


class MoELayer(MoEBlock):
    attn: QKNormAttention
    moe: Qwen3MoE


def qwen3_qkv(
    config: Qwen3Config,
    layer: DenseLayer | MoELayer,
    x: Float[Array, "B S D"],
    cos: Float[Array, "B S R"],
    sin: Float[Array, "B S R"],
) -> tuple[Float[Array, "B S H K"], Float[Array, "B S G K"], Float[Array, "B S G K"]]:
    """A layer's attention inputs: pre-norm, projections, per-head RMSNorm of queries and keys
    (before RoPE, as the published model does), RoPE. ``k`` and ``v`` are what a cache keeps."""
    eps, a = config.rms_norm_eps, layer.attn
    h = named("attn_norm", rms_norm, x, layer.attn_norm, eps)
    # In FP8 the three projections are the norm's only backward readers: one FP8 copy for them all.
    kept = shared_input(("q_proj", "k_proj", "value"), "bsd,dhk->bshk", h, saved="attn_norm")
    # The per-head norms' backward needs their inputs: naming them spares the projections.
    q = named("q_proj", lambda: matmul("q_proj", "bsd,dhk->bshk", h, a.wq, shared=kept))
    k = named("k_proj", lambda: matmul("k_proj", "bsd,dgk->bsgk", h, a.wk, shared=kept))
    q = named("query", lambda: apply_rope(rms_norm(q, a.q_norm, eps), cos, sin))
    k = named("key", lambda: apply_rope(rms_norm(k, a.k_norm, eps), cos, sin))
    return q, k, named("value", lambda: matmul("value", "bsd,dgk->bsgk", h, a.wv, shared=kept))


def qwen3_attention_out(
    layer: DenseLayer | MoELayer, x: Float[Array, "B S D"], ctx: Float[Array, "B S H K"]
) -> Float[Array, "B S D"]:
    """The output projection added to the residual stream."""
    # The add's result feeds the MLP norm, whose backward needs it: saving this name spares
    # recomputing the projection.
    return x + named("attn_out", lambda: tensor_psum(matmul("attn_out", "bshk,hkd->bsd", ctx, layer.attn.wo)))


def dense_ffn(config: Qwen3Config, layer: DenseLayer, x: Float[Array, "B S D"]) -> Float[Array, "B S D"]:
    """Pre-norm SwiGLU added to the residual stream."""
    h = named("mlp_norm", rms_norm, x, layer.mlp_norm, config.rms_norm_eps)
    return x + swiglu(h, layer.mlp.w_gate, layer.mlp.w_up, layer.mlp.w_down, input_name="mlp_norm")


def moe_ffn(
    config: Qwen3Config, layer: MoELayer, x: Float[Array, "B S D"], impl: str
) -> tuple[Float[Array, "B S D"], tuple[Int[Array, " E"], Float[Array, " E"], Int[Array, ""]]]:
    """Pre-norm MoE added to the residual stream; also the layer's expert load, the sum of its
    router probabilities (what the balance loss needs) and the pairs its dispatch dropped."""
    b, s, d = x.shape
    h = named("mlp_norm", rms_norm, x, layer.mlp_norm, config.rms_norm_eps)
    tokens = h.reshape(b * s, d)
    routing = route(tokens, layer.moe.router, top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob)
    out, dropped = moe_experts(tokens, routing, layer.moe.w_gate, layer.moe.w_up, layer.moe.w_down, impl=impl,
                               dispatch=dispatch_of(config))  # fmt: skip
    return x + out.reshape(b, s, d), (*layer_router_stats(routing, config.num_experts), dropped)


def qwen3_layer(config, layer, x, cos, sin, segment_ids, kind: str, impl: str):
    """One decoder layer: pre-norm attention, then the dense or MoE MLP (with router stats)."""
    x = named("layer_input", lambda: x)
    q, k, v = qwen3_qkv(config, layer, x, cos, sin)
    ctx = causal_attention(q, k, v, scale=config.head_dim**-0.5, segment_ids=segment_ids, implementation=config.attention)
    x = qwen3_attention_out(layer, x, ctx)  # causal_attention names "context" and "attn_lse"
    if kind == "dense":
        return dense_ffn(config, layer, x), None
    return moe_ffn(config, layer, x, impl)


def cast_layer(layer, dtype):
    """Compute-dtype copy of a layer's weights; a router stays float32 (it routes)."""
    if isinstance(layer, MoELayer):
        router = layer.moe.router
        layer = jax.tree.map(lambda w: w.astype(dtype), layer)
        return eqx.tree_at(lambda l: l.moe.router, layer, router)
    return jax.tree.map(lambda w: w.astype(dtype), layer)


def layer_runs(model: Qwen3) -> list[tuple[Any, str]]:
    """The runs of one layer kind in model order: (the run's slice of its stack, ``"dense"`` or
    ``"moe"``); decoding scans each."""
    out = []
    for kind, first, end in model.config.runs:
        stack = model.dense_layers if kind == "dense" else model.moe_layers
        out.append((_rows(stack, first, end), kind))
    return out


def _rows(stack, first: int, end: int):
    n = jax.tree.leaves(stack)[0].shape[0]
    return stack if (first, end) == (0, n) else jax.tree.map(lambda w: w[first:end], stack)


def block_stacks(model: Qwen3, pipelined: bool = False) -> list[tuple[Any, Any, tuple[str, ...]]]:
    """Per :attr:`~zoo.qwen3.config.Qwen3Config.blocks` entry: its dense and MoE layers shaped
    ``[repeats, per repeat, ...]`` (``None`` where the pattern has none) and the pattern.
    ``pipelined``: inside a step that pipelines the stacks, each block holds its kinds' whole
    stacks (:func:`block_pipeline` checks it), this device's stage of them."""
    out = []
    for block in model.config.blocks:
        parts = []
        for kind, stack, first in (("dense", model.dense_layers, block.dense_first), ("moe", model.moe_layers, block.moe_first)):
            n, per = block.count(kind), block.pattern.count(kind)
            sub = None if n == 0 else (stack if pipelined else _rows(stack, first, first + n))
            parts.append(None if sub is None else jax.tree.map(lambda w, per=per: w.reshape(-1, per, *w.shape[1:]), sub))
        out.append((*parts, block.pattern))
    return out


def block_pipeline(model: Qwen3) -> PipelineSplit | None:
    """How the step pipelines each block (``None`` outside a pipelined step): each block is a
    GPipe pass over its repeats, a stage holding whole repeats (the mesh check made sure it
    can: :meth:`~zoo.qwen3.config.Qwen3Config.check_pipeline`)."""
    found = [pipeline_of(s) for s in (model.dense_layers, model.moe_layers) if s is not None]
    return next((f[0] for f in found if f is not None), None)


class Qwen3Output(NamedTuple):
    """What a forward pass returns (``model(ids)`` returns only ``logits``)."""

    logits: Float[Array, "B S V"]
    hidden_states: Float[Array, "L1 B S D"] | None
    router: RouterStats | None  # the MoE layers' router statistics (None without any)


class Qwen3(GQAGeneration):
    """Qwen3 / Qwen3-MoE causal language model: ``model(input_ids) -> logits``.

    Build fresh with ``Qwen3(config, key=key)``, or from arrays with ``Qwen3(config, arrays=arrays)``.
    With ``mesh=`` a fresh model is made in place, sharded over the mesh: each device creates
    only its shard (:func:`zoo.params.init_arrays`), with the values of the unsharded init.
    ``expert_impl``: the routed experts' path (:func:`zoo.layers.moe.resolve_expert_impl`).
    """

    embed: Float[Array, "V D"]
    dense_layers: DenseLayer | None
    moe_layers: MoELayer | None
    final_norm: Float[Array, " D"]
    head: Float[Array, "V D"] | None
    config: Qwen3Config = eqx.field(static=True)
    compute_dtype: jnp.dtype = eqx.field(static=True)
    expert_impl: str = eqx.field(static=True)

    config_cls: ClassVar[type] = Qwen3Config
    model_types: ClassVar[tuple[str, ...]] = ("qwen3", "qwen3_moe")
    placement_map: ClassVar[type] = Qwen3Placement
    precision_map: ClassVar[type] = Qwen3Precision
    training_options: ClassVar[type] = Qwen3Training

    def __init__(self, config: Qwen3Config, *, key: PRNGKeyArray | None = None, arrays=None, mesh: Any = None,
                 param_dtype=jnp.float32, compute_dtype=jnp.float32, expert_impl: str = "auto"):  # fmt: skip
        resolve_expert_impl(expert_impl)  # validates the name
        self.config, self.compute_dtype, self.expert_impl = config, jnp.dtype(compute_dtype), expert_impl
        stacks = {"dense_layers": "Ld", "moe_layers": "Lm"}
        arrays = model_arrays("Qwen3", config, qwen3_params(config), stacks, key=key, arrays=arrays, mesh=mesh,
                              dtype=param_dtype)  # fmt: skip
        self.embed = arrays["embed"]
        self.dense_layers = build(DenseLayer, arrays, "dense_layers.") if config.dense_layer_ids else None
        self.moe_layers = build(MoELayer, arrays, "moe_layers.") if config.moe_layer_ids else None
        self.final_norm = arrays["final_norm"]
        self.head = None if config.tie_word_embeddings else arrays["head"]

    def with_expert_impl(self, expert_impl: str) -> Qwen3:
        """The same weights with another expert path."""
        return Qwen3(self.config, arrays=flatten(self), compute_dtype=self.compute_dtype, expert_impl=expert_impl)

    def unembedding(self) -> Float[Array, "V D"]:
        """The output head's matrix (the embedding where tied)."""
        return self.embed if self.head is None else self.head

    @classmethod
    def param_specs(cls, config: Qwen3Config) -> dict[str, Param]:
        return qwen3_params(config)

    def forward(self, input_ids: Int[Array, "B S"], *, positions=None, segment_ids=None, placement=None,
                return_hidden: bool = False, head: bool = True) -> Qwen3Output:  # fmt: skip
        """Logits, the router statistics summed over the MoE layers (for the balance loss and the
        expert load), and with ``return_hidden`` the hidden states as ``transformers`` reports them."""
        config, dtype = self.config, self.compute_dtype
        cos, sin = rope_cos_sin(config.rope, config.head_dim, positions_for(input_ids, positions))
        policy = layer_policy(placement, self)
        x = embed(self.embed, input_ids, dtype, vocab_size=config.vocab_size)
        outputs, loads, probs, dropped = [x[None]], [], [], []
        split = block_pipeline(self)
        rows = (cos, sin, segment_ids)  # per-row inputs: cut into micro-batches when pipelined
        for block, (dense, moe, pattern) in zip(config.blocks, block_stacks(self, pipelined=split is not None)):

            def body(h, layers, rows, pattern=pattern):
                taken, hs, block_loads, block_probs, block_dropped = {"dense": 0, "moe": 0}, [], [], [], []
                for kind in pattern:  # the repeat's layers, in their stored order
                    layer = jax.tree.map(lambda w, i=taken[kind]: w[i], layers[kind])
                    taken[kind] += 1
                    layer = gather_layer(cast_layer(layer, dtype))
                    h, stats = qwen3_layer(config, layer, h, *rows, kind, self.expert_impl)
                    if stats is not None:
                        block_loads.append(stats[0])
                        block_probs.append(stats[1])
                        block_dropped.append(stats[2])
                    hs.append(h)
                stacked = lambda xs, axis=0: jnp.stack(xs, axis=axis) if xs else None  # noqa: E731
                return h, (stacked(hs, 1) if return_hidden else None, stacked(block_loads), stacked(block_probs),
                           stacked(block_dropped))  # fmt: skip

            # The router probabilities' sums are per-layer outputs, not a carry: pipelined
            # (zoo.pipeline), each micro-batch's are summed, like the expert load.
            here = None if split is None else (split, block.repeats)
            x, (ys, load, prob, block_drops) = scan_layers(
                body, x, {"dense": dense, "moe": moe}, policy=policy, rows=rows, combine=("rows", "sum", "sum", "sum"),
                pipeline=here,
            )  # fmt: skip
            if load is not None:
                loads.append(load.reshape(-1, *load.shape[2:]))
                probs.append(jnp.sum(prob, axis=(0, 1)))
                dropped.append(jnp.sum(block_drops))
            if return_hidden:  # [repeats, rows, per repeat, S, D] -> [layers, rows, S, D]
                outputs.append(jnp.moveaxis(ys, 2, 1).reshape(-1, *ys.shape[1:2], *ys.shape[3:]))
        x = rms_norm(x, self.final_norm, config.rms_norm_eps)
        logits = unembed(x, self.unembedding(), vocab_size=config.vocab_size) if head else x
        hidden = None
        if return_hidden:
            per_layer = jnp.concatenate(outputs[1:], axis=0)
            hidden = jnp.concatenate([outputs[0], per_layer[:-1], x[None]], axis=0).astype(jnp.float32)
        stats = RouterStats(jnp.concatenate(loads, axis=0), sum(probs[1:], probs[0]), sum(dropped)) if loads else None
        return Qwen3Output(logits, hidden, stats)

    # -- training (zoo/qwen3/loss.py) ---------------------------------------------------------
    def loss(self, input_ids, *, options: Any = None, positions=None, segment_ids=None, loss_mask=None, placement=None):
        """Next-token loss plus ``aux_loss_coef`` times the Switch-style balance loss of the
        MoE layers (``transformers``' ``router_aux_loss_coef``); logs both and the expert load."""
        o = options_or_default(self, options)
        labels, mask = shifted_targets(input_ids, segment_ids, loss_mask)
        out = self.forward(input_ids, positions=positions, segment_ids=segment_ids, placement=placement, head=False)
        lm = chunked_cross_entropy(out.logits, self.unembedding(), labels, mask, vocab_size=self.config.vocab_size)
        if out.router is None:
            return lm, {"lm_loss": lm}
        coef = self.config.router_aux_loss_coef if o.aux_loss_coef is None else o.aux_loss_coef
        balance = switch_balance_loss(out.router, self.config.num_experts_per_tok)
        metrics = {"lm_loss": lm, "balance_loss": balance, "expert_load": out.router.load}
        if self.config.moe_overflow == "drop":
            metrics["moe_dropped_pairs"] = out.router.dropped_pairs
        return lm + coef * balance, metrics

    # -- generation: the shared grouped-query decoder (zoo.layers.gqa_decode) ----------------
    def decode_layers(self) -> GQALayers:
        """Qwen3's layers around attention, dense and MoE; the cache keeps the keys after their
        per-head norm and RoPE, and the values."""
        config = self.config

        def finish(layer, h, ctx, kind):
            h = qwen3_attention_out(layer, h, ctx)
            return dense_ffn(config, layer, h) if kind == "dense" else moe_ffn(config, layer, h, self.expert_impl)[0]

        return GQALayers(
            runs=layer_runs(self),
            qkv=lambda layer, h, cos, sin: qwen3_qkv(config, layer, h, cos, sin),
            finish=finish,
            cast=lambda layer: cast_layer(layer, self.compute_dtype),
        )

    # -- Hugging Face checkpoints ------------------------------------------------------------
    @classmethod
    def hf_check(cls, config: Qwen3Config, keys: set[str]) -> None:
        check_layer_kinds(config, keys)

    # -- layout on a mesh ----------------------------------------------------------------
    @classmethod
    def check_layout(cls, config: Qwen3Config, mesh: Any, *, virtual_stages: int = 1) -> None:
        config.check_pipeline(axis_size(mesh, PIPELINE), virtual_stages)

