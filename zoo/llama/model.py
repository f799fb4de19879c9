"""Llama 3.x: grouped-query attention, llama3 RoPE, SwiGLU, RMSNorm; tied or untied head.

Dimension letters used in shapes below:
    B batch · S sequence · D model width · H query heads · G key/value heads · K head size
    F MLP hidden · V vocabulary · L layers · R rotary frequencies (K / 2)

Layer parameters are stored stacked (leading ``L``) and the decoder runs them with
``jax.lax.scan``; a stacked field is annotated ``"*L ..."`` (an unstacked slice drops ``L``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo.core.layout import model_arrays
from zoo.core.named import named
from zoo.core.params import Param, build
from zoo.hooks.step import gather_layer, tensor_psum
from zoo.layers import apply_rope, causal_attention, embed, rms_norm, rope_cos_sin, swiglu, unembed
from zoo.layers.decoder import DenseBlock, GQAttention
from zoo.layers.embed import positions_for
from zoo.layers.fp8 import matmul, shared_input
from zoo.layers.gqa_decode import GQAGeneration, GQALayers
from zoo.layers.stack import scan_layers
from zoo.llama.config import LlamaConfig
from zoo.llama.placement import LlamaPlacement
from zoo.llama.precision import LlamaPrecision
from zoo.loss import NextTokenLM
from zoo.placement import layer_policy


def llama_params(config: LlamaConfig) -> dict[str, Param]:
    """Every parameter of :class:`Llama`: layout, init and Hugging Face checkpoint key."""
    layer = "model.layers.{L}."
    specs = {
        "embed": Param("V D", "model.embed_tokens.weight", "V D"),
        "layers.attn_norm": Param("L D", layer + "input_layernorm.weight", "D", init="ones"),
        "layers.attn.wq": Param("L D H K", layer + "self_attn.q_proj.weight", "(H K) D", matmul="query"),
        "layers.attn.wk": Param("L D G K", layer + "self_attn.k_proj.weight", "(G K) D", matmul="key"),
        "layers.attn.wv": Param("L D G K", layer + "self_attn.v_proj.weight", "(G K) D", matmul="value"),
        "layers.attn.wo": Param("L H K D", layer + "self_attn.o_proj.weight", "D (H K)", matmul="attn_out"),
        "layers.mlp_norm": Param("L D", layer + "post_attention_layernorm.weight", "D", init="ones"),
        "layers.mlp.w_gate": Param("L D F", layer + "mlp.gate_proj.weight", "F D", matmul="mlp_gate"),
        "layers.mlp.w_up": Param("L D F", layer + "mlp.up_proj.weight", "F D", matmul="mlp_up"),
        "layers.mlp.w_down": Param("L F D", layer + "mlp.down_proj.weight", "D F", matmul="mlp_down"),
        "final_norm": Param("D", "model.norm.weight", "D", init="ones"),
    }
    if not config.tie_word_embeddings:
        specs["head"] = Param("V D", "lm_head.weight", "V D")
    return specs


class LlamaLayer(DenseBlock):
    """One decoder layer (or, stacked, all of them)."""

    attn: GQAttention


def llama_layer(
    config: LlamaConfig,
    layer: LlamaLayer,
    x: Float[Array, "B S D"],
    cos: Float[Array, "B S R"],
    sin: Float[Array, "B S R"],
    segment_ids: Int[Array, "B S"] | None,
) -> Float[Array, "B S D"]:
    """Pre-norm attention then pre-norm SwiGLU, each added to the residual stream.

    :func:`~zoo.layers.named.named` marks every intermediate the backward pass may need; the
    placement map decides for each whether it is kept, recomputed or offloaded.
    """
    x = named("layer_input", lambda: x)
    q, k, v = llama_qkv(config, layer, x, cos, sin)
    ctx = causal_attention(q, k, v, scale=config.head_dim**-0.5, segment_ids=segment_ids, implementation=config.attention)
    return llama_post_attention(config, layer, x, ctx)  # causal_attention names "context" and "attn_lse"


def llama_qkv(
    config: LlamaConfig,
    layer: LlamaLayer,
    x: Float[Array, "B S D"],
    cos: Float[Array, "B S R"],
    sin: Float[Array, "B S R"],
) -> tuple[Float[Array, "B S H K"], Float[Array, "B S G K"], Float[Array, "B S G K"]]:
    """A layer's attention inputs from its residual stream: pre-norm, projections, RoPE on
    queries and keys. ``k`` and ``v`` are what a generation cache keeps (``zoo.generate``)."""
    eps, a = config.rms_norm_eps, layer.attn
    h = named("attn_norm", rms_norm, x, layer.attn_norm, eps)
    # In FP8 the three projections are the norm's only backward readers: one FP8 copy for them all.
    kept = shared_input(("query", "key", "value"), "bsd,dhk->bshk", h, saved="attn_norm")
    q = named("query", lambda: apply_rope(matmul("query", "bsd,dhk->bshk", h, a.wq, shared=kept), cos, sin))
    k = named("key", lambda: apply_rope(matmul("key", "bsd,dgk->bsgk", h, a.wk, shared=kept), cos, sin))
    v = named("value", lambda: matmul("value", "bsd,dgk->bsgk", h, a.wv, shared=kept))
    return q, k, v


def llama_post_attention(
    config: LlamaConfig, layer: LlamaLayer, x: Float[Array, "B S D"], ctx: Float[Array, "B S H K"]
) -> Float[Array, "B S D"]:
    """The rest of a layer after attention: output projection added to the residual stream
    ``x``, then pre-norm SwiGLU added to it."""
    eps, a = config.rms_norm_eps, layer.attn
    # The projection only feeds the residual add, but the add's result feeds the MLP norm,
    # whose backward needs it: saving this name spares recomputing the projection.
    x = x + named("attn_out", lambda: tensor_psum(matmul("attn_out", "bshk,hkd->bsd", ctx, a.wo)))
    h = named("mlp_norm", rms_norm, x, layer.mlp_norm, eps)
    return x + swiglu(h, layer.mlp.w_gate, layer.mlp.w_up, layer.mlp.w_down, input_name="mlp_norm")


class Llama(GQAGeneration, NextTokenLM):
    """Llama 3.x causal language model: ``model(input_ids) -> logits``.

    Build fresh with ``Llama(config, key=key)``, or from arrays (``{path: array}``, as
    :func:`zoo.from_pretrained` does) with ``Llama(config, arrays=arrays)``.
    With ``mesh=`` a fresh model is made in place, sharded over the mesh: each device creates
    only its shard (:func:`zoo.params.init_arrays`), with the values of the unsharded init.
    """

    embed: Float[Array, "V D"]
    layers: LlamaLayer
    final_norm: Float[Array, " D"]
    head: Float[Array, "V D"] | None
    config: LlamaConfig = eqx.field(static=True)
    compute_dtype: jnp.dtype = eqx.field(static=True)

    config_cls: ClassVar[type] = LlamaConfig
    model_types: ClassVar[tuple[str, ...]] = ("llama",)
    placement_map: ClassVar[type] = LlamaPlacement
    precision_map: ClassVar[type] = LlamaPrecision

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray | None = None, arrays=None, mesh: Any = None,
                 param_dtype=jnp.float32, compute_dtype=jnp.float32):  # fmt: skip
        self.config = config
        self.compute_dtype = jnp.dtype(compute_dtype)
        arrays = model_arrays("Llama", config, llama_params(config), {"layers": "L"}, key=key, arrays=arrays, mesh=mesh,
                              dtype=param_dtype)  # fmt: skip
        self.layers = build(LlamaLayer, arrays, "layers.")
        self.embed = arrays["embed"]
        self.final_norm = arrays["final_norm"]
        self.head = None if config.tie_word_embeddings else arrays["head"]

    def forward(self, input_ids: Int[Array, "B S"], *, positions=None, segment_ids=None, placement=None,
                return_hidden: bool = False, head: bool = True) -> tuple[Float[Array, "B S V"], Float[Array, "L1 B S D"] | None]:  # fmt: skip
        """Logits, and with ``return_hidden`` the hidden states as ``transformers`` reports them:
        the embedding output, the outputs of layers 1..L-1, then the final norm of layer L's output."""
        config, dtype = self.config, self.compute_dtype
        cos, sin = rope_cos_sin(config.rope, config.head_dim, positions_for(input_ids, positions))
        x = embed(self.embed, input_ids, dtype, vocab_size=config.vocab_size)

        def body(h, layer, rows):
            layer = gather_layer(jax.tree.map(lambda w: w.astype(dtype), layer))
            h = llama_layer(config, layer, h, *rows)
            return h, (h if return_hidden else None)

        x0 = x
        rows = (cos, sin, segment_ids)
        x, per_layer = scan_layers(
            body, x, self.layers, policy=layer_policy(placement, self), rows=rows, combine="rows"
        )
        x = rms_norm(x, self.final_norm, config.rms_norm_eps)
        logits = unembed(x, self.unembedding(), vocab_size=config.vocab_size) if head else x
        hidden = None
        if return_hidden:
            hidden = jnp.concatenate([x0[None], per_layer[:-1], x[None]], axis=0).astype(jnp.float32)
        return logits, hidden

    def unembedding(self) -> Float[Array, "V D"]:
        """The output head's matrix (the embedding where tied)."""
        return self.embed if self.head is None else self.head

    @classmethod
    def param_specs(cls, config: LlamaConfig) -> dict[str, Param]:
        return llama_params(config)

    # -- generation: the shared grouped-query decoder (zoo.layers.gqa_decode) ----------------
    def decode_layers(self) -> GQALayers:
        """Llama's layer around attention; the cache keeps the keys after RoPE and the values."""
        config = self.config
        return GQALayers(
            runs=[(self.layers, None)],
            qkv=lambda layer, h, cos, sin: llama_qkv(config, layer, h, cos, sin),
            finish=lambda layer, h, ctx, _: llama_post_attention(config, layer, h, ctx),
            cast=lambda layer: jax.tree.map(lambda w: w.astype(self.compute_dtype), layer),
        )
