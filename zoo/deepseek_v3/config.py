"""DeepSeek-V3 hyper-parameters, presets, FLOP and parameter counts, and the HF ``config.json`` mapping."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.mesh import WEIGHT_SHARDS
from zoo.core.protocol import AxisRule, check_positive_ints
from zoo.errors import ConfigError
from zoo.hf.config import HFConfig, decoder_hf
from zoo.layers.decoder import DecoderConfig
from zoo.layers.moe_dispatch import dispatch_of
from zoo.layers.rope import Rope, yarn_mscale

DEEPSEEK_V3_ROPE = Rope(
    theta=10000.0, kind="yarn", factor=40.0, original_max_position_embeddings=4096,
    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
)  # fmt: skip


# Dimension letter -> mesh axis (and the config field behind it, for errors).
DEEPSEEK_V3_AXES: dict[str, AxisRule] = {
    "H": AxisRule("tensor", "num_heads"),
    "F": AxisRule("tensor", "intermediate_size", pad=True),
    "M": AxisRule("tensor", "moe_intermediate_size", pad=True),
    "X": AxisRule("tensor", "moe_intermediate_size * n_shared_experts", pad=True),
    "E": AxisRule("expert", "n_routed_experts", stored_apart_only=True),
    "D": AxisRule(WEIGHT_SHARDS, "hidden_size", optional=("expert",)),
    "Q": AxisRule(WEIGHT_SHARDS, "q_lora_rank", optional=("expert",)),
    "C": AxisRule(WEIGHT_SHARDS, "kv_lora_rank", optional=("expert",)),
    "V": AxisRule(("pipeline", "fsdp"), "vocab_size", pad=True),
    # The MoE stack is pipelined (stages over "pipeline", padding layers skipped: zoo.pipeline).
    # The first_k_dense_replace dense layers (3 of 61 in the published model) are not: they
    # run whole on every stage before the MoE stack, replicated over "pipeline" (no second
    # GPipe pass, with its own bubble, for a few layers), and the MTP block runs after it.
    "Lm": AxisRule("pipeline", "num_layers - first_k_dense_replace", pad=True),
}


@dataclass(frozen=True)
class DeepseekV3Config(DecoderConfig):
    """Architecture of a DeepSeek-V3 decoder. Field names follow Hugging Face's where they exist
    (the shared ones: :class:`~zoo.layers.decoder.DecoderConfig`).

    ``q_lora_rank=None`` gives a plain query projection (as in DeepSeek-V2-Lite).
    ``mtp`` (a loading option, not in config.json): build the multi-token-prediction module
    from the ``num_nextn_predict_layers`` layers stored after the decoder's.
    """

    axis_rules: ClassVar[dict[str, AxisRule]] = DEEPSEEK_V3_AXES

    moe_intermediate_size: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 1
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope: Rope = field(default_factory=lambda: DEEPSEEK_V3_ROPE)
    rope_interleave: bool = True
    max_position_embeddings: int = 163840
    num_nextn_predict_layers: int = 0
    mtp: bool = False
    aux_loss_alpha: float = 0.0
    # Not architecture (never in config.json): expert parallelism's all-to-all rounds, a slot of
    # capacity_factor x the mean rows per destination, and past it "dropless" (more rounds) or
    # "drop" (dropped, counted); the rows travel by ragged all-to-alls where XLA has them
    # ("auto"), or "padded" / "ragged": zoo.layers.moe_dispatch.
    capacity_factor: float = 1.25
    moe_overflow: str = "dropless"
    moe_transport: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        dispatch_of(self)
        check_positive_ints(
            self, "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
        )  # fmt: skip
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ConfigError(f"DeepseekV3Config.q_lora_rank must be a positive integer or None, got {self.q_lora_rank!r}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"DeepseekV3Config.n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})"
            )
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("DeepseekV3Config: group-limited routing scores a group by its top 2 experts; "
                              f"n_routed_experts / n_group = {self.n_routed_experts // self.n_group} < 2")  # fmt: skip
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"DeepseekV3Config.topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
        kept = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > kept:
            raise ConfigError(
                f"DeepseekV3Config.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {kept} experts "
                f"in the topk_group={self.topk_group} groups kept"
            )
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ConfigError(
                f"DeepseekV3Config.first_k_dense_replace ({self.first_k_dense_replace}) must be in 0..num_layers ({self.num_layers})"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"DeepseekV3Config.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")
        if self.v_head_dim > self.qk_head_dim:
            raise ConfigError(
                f"DeepseekV3Config.v_head_dim ({self.v_head_dim}) larger than the query/key head "
                f"({self.qk_head_dim} = qk_nope_head_dim + qk_rope_head_dim) is not supported"
            )
        if self.mtp and self.num_nextn_predict_layers != 1:
            raise ConfigError(
                f"DeepseekV3Config: mtp=True needs num_nextn_predict_layers == 1 (depth-1 MTP, as published), "
                f"got {self.num_nextn_predict_layers}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace

    @property
    def own_sizes(self) -> dict[str, int]:
        return {
            "M": self.moe_intermediate_size,
            "X": self.moe_intermediate_size * self.n_shared_experts,
            "Ld": self.num_dense_layers,
            "Lm": self.num_moe_layers,
            "H": self.num_heads,
            "Q": self.q_lora_rank or 0,
            "C": self.kv_lora_rank,
            "A": self.kv_lora_rank + self.qk_rope_head_dim,
            "K": self.qk_head_dim,
            "N": self.qk_nope_head_dim,
            "P": self.qk_rope_head_dim,
            "U": self.v_head_dim,
            "W": self.qk_nope_head_dim + self.v_head_dim,
            "E": self.n_routed_experts,
            "D2": 2 * self.hidden_size,
        }

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's mscale² as the published model does."""
        scale = self.qk_head_dim**-0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def _attn_matmul(self) -> int:
        d, h = self.hidden_size, self.num_heads
        q = d * self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim if self.q_lora_rank else d * h * self.qk_head_dim
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (3x forward) per token; only the ``num_experts_per_tok`` activated
        routed experts (and the shared ones) count, plus the router and causal attention."""
        d = self.hidden_size
        dense_mlp = 3 * d * self.intermediate_size
        moe_mlp = 3 * d * self.moe_intermediate_size * (self.num_experts_per_tok + self.n_shared_experts)
        moe_mlp += d * self.n_routed_experts
        matmul = self.num_layers * self._attn_matmul() + self.num_dense_layers * dense_mlp + self.num_moe_layers * moe_mlp
        matmul += self.vocab_size * d
        attn = 3 * self.num_layers * self.num_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        return 6.0 * matmul + attn

    @classmethod
    def preset(cls, name: str, model_type: str | None = None) -> DeepseekV3Config:
        return preset(name)

    # -- Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_hf(cls, data: dict[str, Any], source: str = "config.json", *, mtp: bool = False,
                capacity_factor: float = 1.25, moe_overflow: str = "dropless", moe_transport: str = "auto") -> DeepseekV3Config:  # fmt: skip
        c = HFConfig(data, source)
        scoring = c.get("scoring_func", str, "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"{source}: field 'scoring_func' is {scoring!r}; DeepSeek-V3 routing is 'sigmoid'")
        method = c.get("topk_method", str, "noaux_tc")
        if method != "noaux_tc":
            raise ConfigError(f"{source}: field 'topk_method' is {method!r}; only 'noaux_tc' (DeepSeek-V3) is supported")
        return cls(
            **c.decoder_fields(max_position_embeddings=163840),
            moe_intermediate_size=c.get("moe_intermediate_size", int),
            q_lora_rank=c.get("q_lora_rank", int, None),
            kv_lora_rank=c.get("kv_lora_rank", int),
            qk_nope_head_dim=c.get("qk_nope_head_dim", int),
            qk_rope_head_dim=c.get("qk_rope_head_dim", int),
            v_head_dim=c.get("v_head_dim", int),
            n_routed_experts=c.get("n_routed_experts", int),
            num_experts_per_tok=c.get("num_experts_per_tok", int),
            n_group=c.get("n_group", int, 1),
            topk_group=c.get("topk_group", int, 1),
            n_shared_experts=c.get("n_shared_experts", int, 0),
            first_k_dense_replace=c.get("first_k_dense_replace", int, 0),
            routed_scaling_factor=c.get("routed_scaling_factor", float, 1.0),
            norm_topk_prob=c.get("norm_topk_prob", bool, False),
            rope=c.parsed("rope settings", Rope.from_hf),
            rope_interleave=c.get("rope_interleave", bool, True),
            num_nextn_predict_layers=c.get("num_nextn_predict_layers", int, 0),
            mtp=mtp,
            capacity_factor=capacity_factor,
            moe_overflow=moe_overflow,
            moe_transport=moe_transport,
            aux_loss_alpha=c.get("aux_loss_alpha", float, 0.0),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            **decoder_hf(self),
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "head_dim": self.qk_rope_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "n_shared_experts": self.n_shared_experts,
            "first_k_dense_replace": self.first_k_dense_replace,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "rope_interleave": self.rope_interleave,
            "num_nextn_predict_layers": self.num_nextn_predict_layers if self.mtp else 0,
            "aux_loss_alpha": self.aux_loss_alpha,
            **self.rope.to_hf(),
        }


def _preset(**kw) -> DeepseekV3Config:
    return DeepseekV3Config(**kw)


PRESETS: dict[str, DeepseekV3Config] = {
    "deepseek-v3-671b": _preset(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_layers=61,
        num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
        first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=1,
        aux_loss_alpha=0.001, bos_token_id=0, eos_token_id=1,
    ),
    # Byte-level models for tests and CPU training (vocab 256: one token per byte).
    "tiny": _preset(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_layers=3, num_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
    ),
    "small": _preset(
        vocab_size=256, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_layers=4, num_heads=8,
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=16, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
    ),
    # The shared benchmark shape (benchmarks/README.md): no group limit.
    "bench": _preset(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256, num_layers=4,
        num_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=16, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0,
    ),
}  # fmt: skip


def preset(name: str, **overrides) -> DeepseekV3Config:
    """A named configuration (``deepseek-v3-671b``, ``small``, ...), optionally with fields replaced."""
    if name not in PRESETS:
        raise ConfigError(f"unknown DeepSeek-V3 preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
