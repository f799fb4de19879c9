"""DeepSeek-V3: Multi-head Latent Attention, sigmoid-routed MoE with shared experts, MTP.

Dimension letters used in shapes below:
    B batch · S sequence · T tokens (B·S) · D model width · V vocabulary · H heads
    Q query latent (q_lora_rank) · C key/value latent (kv_lora_rank) · A = C + P
    K query/key head size (N + P) · N its no-rope part · P its rope part · U value head size
    W = N + U (what the latent expands to per head) · F dense MLP hidden
    E routed experts · M expert hidden · X shared experts' hidden · R rotary frequencies (P / 2)
    Ld dense layers (the first ``first_k_dense_replace``) · Lm MoE layers

The dense and the MoE layers are two stacks, each run with ``jax.lax.scan``; a stacked field
is annotated ``"*L ..."``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from zoo.core.layout import model_arrays
from zoo.core.params import Param, build, flatten
from zoo.core.protocol import CausalLM, options_or_default
from zoo.deepseek_v3 import decode
from zoo.deepseek_v3.checkpoint import check_expert_count, mtp_keys_skipped
from zoo.deepseek_v3.config import DeepseekV3Config
from zoo.deepseek_v3.layer import DenseLayer, MoELayer, cast_moe, dense_layer, moe_layer
from zoo.deepseek_v3.loss import DeepseekV3Training, deepseek_v3_loss
from zoo.deepseek_v3.mla import MLA, mla, mla_expand, mla_project  # noqa: F401  (re-exported: their home before mla.py)
from zoo.deepseek_v3.moe import update_router_bias
from zoo.deepseek_v3.placement import DeepseekV3Placement
from zoo.deepseek_v3.precision import DeepseekV3Precision
from zoo.hooks.pipeline import per_layer_to_stored
from zoo.hooks.step import context_positions, context_size, gather_layer
from zoo.layers import embed, rms_norm, rope_cos_sin, unembed
from zoo.layers.embed import positions_for
from zoo.layers.fp8 import matmul
from zoo.layers.moe import resolve_expert_impl
from zoo.layers.stack import checkpoint_layer, scan_layers
from zoo.loss import shifted_targets
from zoo.placement import layer_policy

# How generation decodes with the MLA cache (zoo/deepseek_v3/decode.py; the first is the default).


def deepseek_v3_params(config: DeepseekV3Config) -> dict[str, Param]:
    """Every parameter of :class:`DeepseekV3`: layout, init and Hugging Face checkpoint key."""
    specs = {"embed": Param("V D", "model.embed_tokens.weight", "V D")}

    def block(prefix: str, stack: str, hf_layer: str) -> None:
        def put(path, axes, key, layout, **kw):
            specs[f"{prefix}.{path}"] = Param(f"{stack} {axes}".strip(), hf_layer + key, layout, **kw)

        put("attn_norm", "D", "input_layernorm.weight", "D", init="ones")
        if config.q_lora_rank is None:
            put("attn.wq", "D H K", "self_attn.q_proj.weight", "(H K) D", matmul="query")
        else:
            put("attn.wq_a", "D Q", "self_attn.q_a_proj.weight", "Q D", matmul="q_a")
            put("attn.q_norm", "Q", "self_attn.q_a_layernorm.weight", "Q", init="ones")
            put("attn.wq_b", "Q H K", "self_attn.q_b_proj.weight", "(H K) Q", matmul="query")
        put("attn.wkv_a", "D A", "self_attn.kv_a_proj_with_mqa.weight", "A D", matmul="kv_a")
        put("attn.kv_norm", "C", "self_attn.kv_a_layernorm.weight", "C", init="ones")
        put("attn.wkv_b", "C H W", "self_attn.kv_b_proj.weight", "(H W) C", matmul="kv_b")
        put("attn.wo", "H U D", "self_attn.o_proj.weight", "D (H U)", matmul="attn_out")
        put("mlp_norm", "D", "post_attention_layernorm.weight", "D", init="ones")
        if stack == "Ld":
            put("mlp.w_gate", "D F", "mlp.gate_proj.weight", "F D", matmul="mlp_gate")
            put("mlp.w_up", "D F", "mlp.up_proj.weight", "F D", matmul="mlp_up")
            put("mlp.w_down", "F D", "mlp.down_proj.weight", "D F", matmul="mlp_down")
            return
        put("moe.router", "D E", "mlp.gate.weight", "E D")
        put("moe.router_bias", "E", "mlp.gate.e_score_correction_bias", "E", init="zeros", trainable=False)
        put("moe.w_gate", "E D M", "mlp.experts.{E}.gate_proj.weight", "M D")
        put("moe.w_up", "E D M", "mlp.experts.{E}.up_proj.weight", "M D")
        put("moe.w_down", "E M D", "mlp.experts.{E}.down_proj.weight", "D M")
        if config.n_shared_experts:
            put("moe.shared.w_gate", "D X", "mlp.shared_experts.gate_proj.weight", "X D", matmul="shared_gate")
            put("moe.shared.w_up", "D X", "mlp.shared_experts.up_proj.weight", "X D", matmul="shared_up")
            put("moe.shared.w_down", "X D", "mlp.shared_experts.down_proj.weight", "D X", matmul="shared_down")

    if config.num_dense_layers:
        block("dense_layers", "Ld", "model.layers.{Ld}.")
    if config.num_moe_layers:
        block("moe_layers", "Lm", f"model.layers.{{Lm+{config.num_dense_layers}}}.")
    specs["final_norm"] = Param("D", "model.norm.weight", "D", init="ones")
    if not config.tie_word_embeddings:
        specs["head"] = Param("V D", "lm_head.weight", "V D")
    if config.mtp:
        mtp = f"model.layers.{config.num_layers}."
        specs["mtp.enorm"] = Param("D", mtp + "enorm.weight", "D", init="ones")
        specs["mtp.hnorm"] = Param("D", mtp + "hnorm.weight", "D", init="ones")
        specs["mtp.proj"] = Param("D2 D", mtp + "eh_proj.weight", "D D2", matmul="mtp_proj")
        specs["mtp.final_norm"] = Param("D", mtp + "shared_head.norm.weight", "D", init="ones")
        block("mtp.block", "", mtp)  # an MoE block, as in the published model
    return specs


def mtp_duplicates(config: DeepseekV3Config) -> dict[str, str]:
    """Tensors the published checkpoint stores twice: MTP-layer key -> the main model's param path.
    (Its MTP layer carries its own copies of the shared embedding and output head.)"""
    if not config.num_nextn_predict_layers:
        return {}
    out = {}
    for i in range(config.num_nextn_predict_layers):
        layer = f"model.layers.{config.num_layers + i}."
        out[layer + "embed_tokens.weight"] = "embed"
        out[layer + "shared_head.head.weight"] = "embed" if config.tie_word_embeddings else "head"
    return out


class MTP(eqx.Module):
    """Multi-token prediction, depth 1: from the main model's last hidden state at t and the
    embedding of token t+1, predict token t+2 (embedding and output head shared)."""

    enorm: Float[Array, " D"]
    hnorm: Float[Array, " D"]
    proj: Float[Array, "D2 D"]
    block: MoELayer
    final_norm: Float[Array, " D"]


class DeepseekV3Output(NamedTuple):
    """What a forward pass returns (``model(ids)`` returns only ``logits``)."""

    logits: Float[Array, "B S V"]
    hidden_states: Float[Array, "L1 B S D"] | None
    expert_load: Int[Array, "Lm E"] | None
    balance_loss: Float[Array, ""]
    mtp_logits: Float[Array, "B S V"] | None
    # (token, expert) pairs dropped past the dispatch's capacity, all MoE layers and the MTP
    # block's together (0 unless config.moe_overflow is "drop").
    dropped_pairs: Int[Array, ""] | None = None


class DeepseekV3(CausalLM):
    """DeepSeek-V3 causal language model: ``model(input_ids) -> logits``.

    Build fresh with ``DeepseekV3(config, key=key)``, or from arrays (``{path: array}``, as
    :func:`zoo.from_pretrained` does) with ``DeepseekV3(config, arrays=arrays)``.
    With ``mesh=`` a fresh model is made in place, sharded over the mesh: each device creates
    only its shard (:func:`zoo.params.init_arrays`), with the values of the unsharded init.
    ``expert_impl``: the routed experts' path (:func:`zoo.layers.moe.resolve_expert_impl`), all
    dropless: ``"ragged_dot"`` (``jax.lax.ragged_dot``), ``"capacity"`` (a batched matmul over a
    static per-expert capacity, the overflow through the tile loop; :mod:`zoo.layers.capacity_mlp`),
    ``"grouped"`` (:func:`zoo.layers.grouped_matmul`, a loop over row tiles whose work follows the
    routing), ``"tiled"`` (grouped matmuls from gathers), ``"auto"`` (the default: ``ragged_dot``
    on TPU, ``capacity`` elsewhere), or ``"dense"`` (every expert on every token; the reference the
    tests compare against).
    """

    embed: Float[Array, "V D"]
    dense_layers: DenseLayer | None
    moe_layers: MoELayer | None
    final_norm: Float[Array, " D"]
    head: Float[Array, "V D"] | None
    mtp: MTP | None
    config: DeepseekV3Config = eqx.field(static=True)
    compute_dtype: jnp.dtype = eqx.field(static=True)
    expert_impl: str = eqx.field(static=True)

    config_cls: ClassVar[type] = DeepseekV3Config
    model_types: ClassVar[tuple[str, ...]] = ("deepseek_v3",)
    placement_map: ClassVar[type] = DeepseekV3Placement
    precision_map: ClassVar[type] = DeepseekV3Precision
    training_options: ClassVar[type] = DeepseekV3Training
    layer_blocks: ClassVar[tuple[str, ...]] = ("mtp.block",)
    cache_options: ClassVar[Mapping[str, tuple[tuple[str, ...], str]]] = {
        "mla": (decode.MLA_DECODES, ("DeepSeek-V3 decoding: compressed cache with weight absorption (default), the same "
                              "cache re-expanded every step, or an expanded per-head cache")),
    }  # fmt: skip

    def __init__(self, config: DeepseekV3Config, *, key: PRNGKeyArray | None = None, arrays=None, mesh: Any = None,
                 param_dtype=jnp.float32, compute_dtype=jnp.float32, expert_impl: str = "auto"):  # fmt: skip
        resolve_expert_impl(expert_impl)  # validates the name
        self.config, self.compute_dtype, self.expert_impl = config, jnp.dtype(compute_dtype), expert_impl
        stacks = {"dense_layers": "Ld", "moe_layers": "Lm"}
        arrays = model_arrays("DeepseekV3", config, deepseek_v3_params(config), stacks, key=key, arrays=arrays,
                              mesh=mesh, dtype=param_dtype)  # fmt: skip
        self.embed = arrays["embed"]
        self.dense_layers = build(DenseLayer, arrays, "dense_layers.") if config.num_dense_layers else None
        self.moe_layers = build(MoELayer, arrays, "moe_layers.") if config.num_moe_layers else None
        self.final_norm = arrays["final_norm"]
        self.head = None if config.tie_word_embeddings else arrays["head"]
        self.mtp = build(MTP, arrays, "mtp.") if config.mtp else None

    def with_expert_impl(self, expert_impl: str) -> DeepseekV3:
        """The same weights with another expert path (``"auto"``, ``"ragged_dot"``, ``"capacity"``, ``"grouped"``, ``"tiled"``, ``"dense"``)."""
        return DeepseekV3(
            self.config, arrays=flatten(self), compute_dtype=self.compute_dtype, expert_impl=expert_impl
        )

    def forward(self, input_ids: Int[Array, "B S"], *, positions=None, segment_ids=None, placement=None,
                return_hidden: bool = False, head: bool = True) -> DeepseekV3Output:  # fmt: skip
        """Logits, per-MoE-layer expert load, the summed balance loss, MTP logits (when the
        model has MTP; position t predicts token t+2), and with ``return_hidden`` the hidden
        states as ``transformers`` reports them. ``head=False``: both logits fields hold the
        final-normed hidden states instead (the loss applies the head chunk by chunk)."""
        config, dtype = self.config, self.compute_dtype
        cos, sin = rope_cos_sin(config.rope, config.qk_rope_head_dim, positions_for(input_ids, positions))
        policy = layer_policy(placement, self)
        x = embed(self.embed, input_ids, dtype, vocab_size=config.vocab_size)
        outputs = [x]

        rows = (cos, sin, segment_ids)  # per-row inputs: cut into micro-batches when pipelined
        if self.dense_layers is not None:

            def dense_body(h, layer, rows):
                layer = gather_layer(jax.tree.map(lambda w: w.astype(dtype), layer))
                h = dense_layer(config, layer, h, *rows)
                return h, (h if return_hidden else None)

            x, ys = scan_layers(dense_body, x, self.dense_layers, policy=policy, rows=rows)
            outputs.append(ys)
        load, balance, dropped = None, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
        if self.moe_layers is not None:

            def moe_body(h, layer, rows):
                h, layer_load, layer_balance, layer_dropped = moe_layer(
                    config, gather_layer(cast_moe(layer, dtype)), h, *rows, self.expert_impl
                )
                return h, (layer_load, layer_balance, layer_dropped, h if return_hidden else None)

            # Per-layer balance losses as scan outputs, not a carry: a carry starts typed as varying
            # over every axis the tokens do, while a sequence's balance loss is the same on all the
            # context devices that hold its chunks. Pipelined, micro-batches' loads add up and
            # their balance losses (means over equal numbers of sequences) average.
            x, (load, balances, layer_dropped, ys) = scan_layers(
                moe_body, x, self.moe_layers, policy=policy, rows=rows, combine=("sum", "mean", "sum", "rows")
            )
            balance, dropped = jnp.sum(balances), jnp.sum(layer_dropped)
            outputs.append(ys)
        last = x
        x = rms_norm(x, self.final_norm, config.rms_norm_eps)
        w = self.unembedding() if head else None
        logits = unembed(x, w, vocab_size=config.vocab_size) if head else x
        mtp_logits = None
        if self.mtp is not None:
            mtp_logits, mtp_dropped = self._mtp(last, input_ids, w, cos, sin, segment_ids, dtype, policy)
            dropped = dropped + mtp_dropped
        hidden = None
        if return_hidden:
            per_layer = jnp.concatenate([o for o in outputs[1:] if o is not None], axis=0)
            hidden = jnp.concatenate([outputs[0][None], per_layer[:-1], x[None]], axis=0).astype(jnp.float32)
        return DeepseekV3Output(logits, hidden, load, balance, mtp_logits, dropped)

    def _mtp(self, last, input_ids, head, cos, sin, segment_ids, dtype, policy=None):
        """The MTP block's logits (or final-normed hidden states without ``head``) and its dropped pairs."""
        m, eps = self.mtp, self.config.rms_norm_eps
        # Token t+1 for position t (the last repeats: its prediction is masked out); under
        # context parallelism it may be on another device.
        next_ids = shifted_targets(input_ids)[0]
        next_ids = jnp.where(context_positions(input_ids.shape[1]) + 1 < context_size() * input_ids.shape[1],
                             next_ids, input_ids)  # fmt: skip
        e = rms_norm(embed(self.embed, next_ids, dtype, vocab_size=self.config.vocab_size), m.enorm, eps)
        h = rms_norm(last, m.hnorm, eps)
        x = matmul("mtp_proj", "bsi,id->bsd", jnp.concatenate([e, h], axis=-1), m.proj.astype(dtype))

        def block(x, layer):  # gathered as a MoE layer of the stack is (layer_blocks)
            x, _, _, dropped = moe_layer(self.config, gather_layer(layer), x, cos, sin, segment_ids, self.expert_impl)
            return x, dropped

        # The placement map places the MTP block's tensors as a layer's, and the step re-gathers
        # its weights for the backward pass as a layer's.
        x, dropped = checkpoint_layer(block, policy)(x, cast_moe(m.block, dtype))
        x = rms_norm(x, m.final_norm, eps)
        return (x if head is None else unembed(x, head, vocab_size=self.config.vocab_size)), dropped

    def unembedding(self) -> Float[Array, "V D"]:
        """The output head's matrix (the embedding where tied)."""
        return self.embed if self.head is None else self.head

    @classmethod
    def param_specs(cls, config: DeepseekV3Config) -> dict[str, Param]:
        return deepseek_v3_params(config)

    # -- training (zoo/deepseek_v3/loss.py) ---------------------------------------------------
    def loss(self, input_ids, *, options: Any = None, positions=None, segment_ids=None, loss_mask=None, placement=None):
        """``deepseek_v3_loss`` with the options' MTP weight and balance α; logs its parts and
        the per-layer expert load (summed over micro-batches and devices)."""
        o = options_or_default(self, options)
        total, m = deepseek_v3_loss(
            self, input_ids, positions=positions, segment_ids=segment_ids, loss_mask=loss_mask, placement=placement,
            mtp_weight=o.mtp_weight, balance_alpha=o.balance_alpha,
        )  # fmt: skip
        metrics = {"lm_loss": m.lm_loss, "mtp_loss": m.mtp_loss, "balance_loss": m.balance_loss}
        if m.expert_load is not None:
            metrics["expert_load"] = m.expert_load
        if self.config.moe_overflow == "drop":
            metrics["moe_dropped_pairs"] = m.dropped_pairs
        return total, metrics

    def after_step(self, metrics: Mapping[str, Array], options: Any = None) -> DeepseekV3:
        """The aux-loss-free balancing step on the router bias from the step's expert load."""
        if self.moe_layers is None:
            return self
        rate = options_or_default(self, options).router_bias_rate
        bias, load = self.moe_layers.moe.router_bias, metrics["expert_load"]
        # A pipelined stack's padding layers (zoo.pipeline) have no load: their bias stays zero;
        # in stage order (the interleaved schedule), the layers' loads are put in it too.
        load = per_layer_to_stored(load, bias.shape[0])
        bias = update_router_bias(bias, load, rate)
        return eqx.tree_at(lambda m: m.moe_layers.moe.router_bias, self, bias)

    # -- generation (zoo/deepseek_v3/decode.py: its functions are the methods) -------------
    init_cache = decode.init_cache
    prefill = decode.prefill
    decode_step = decode.decode_step

    # -- Hugging Face checkpoints (zoo/deepseek_v3/checkpoint.py) ---------------------------
    @classmethod
    def hf_skipped(cls, config: DeepseekV3Config, keys: set[str]) -> set[str]:
        return mtp_keys_skipped(config, keys)

    @classmethod
    def hf_duplicates(cls, config: DeepseekV3Config) -> dict[str, str]:
        return mtp_duplicates(config) if config.mtp else {}

    @classmethod
    def hf_check(cls, config: DeepseekV3Config, keys: set[str]) -> None:
        check_expert_count(config, keys)
