"""Llama 3.x hyper-parameters, presets, FLOP and parameter counts, and the HF ``config.json`` mapping."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.protocol import AxisRule, ModelConfig, check_positive
from zoo.errors import ConfigError
from zoo.hf.config import HFConfig
from zoo.layers.attention import check_attention
from zoo.layers.rope import Rope

LLAMA3_ROPE = Rope(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA32_ROPE = dataclasses.replace(LLAMA3_ROPE, factor=32.0)


# Dimension letter -> mesh axis (and the config field behind it, for errors).
LLAMA_AXES: dict[str, AxisRule] = {
    "H": AxisRule("tensor", "num_heads"),
    "G": AxisRule("tensor", "num_kv_heads"),
    "F": AxisRule("tensor", "intermediate_size", pad=True),
    "D": AxisRule("fsdp", "hidden_size"),
    "V": AxisRule(("pipeline", "fsdp"), "vocab_size", pad=True),
    "L": AxisRule("pipeline", "num_layers", pad=True),
}


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Architecture of a Llama 3.x decoder. Field names follow Hugging Face's where they exist."""

    axis_rules: ClassVar[dict[str, AxisRule]] = LLAMA_AXES

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: Rope = field(default_factory=lambda: LLAMA3_ROPE)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Not architecture: which attention path runs (zoo.layers.attention; never in config.json).
    attention: str = "auto"
    # The source config.json's fields this config does not model (pad_token_id, architectures'
    # companions, custom keys), as (name, JSON text) pairs: a save writes them back unchanged.
    hf_extra: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        check_attention(self)
        check_positive(self, "rms_norm_eps", "max_position_embeddings", "initializer_range")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"LlamaConfig.head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def sizes(self) -> dict[str, int]:
        """Size of every dimension letter in the model file's legend."""
        return {
            "V": self.vocab_size,
            "D": self.hidden_size,
            "F": self.intermediate_size,
            "L": self.num_layers,
            "H": self.num_heads,
            "G": self.num_kv_heads,
            "K": self.head_dim,
        }

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward = 3x forward) per token at sequence length ``seq_len``.

        Matmul parameters count 6 each (the embedding lookup is free, the head is a matmul);
        causal attention adds ``6 * L * H * K * S`` (scores and values, half the square).
        """
        d, f, h, g, k = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        per_layer = d * (h + 2 * g) * k + h * k * d + 3 * d * f
        matmul = self.num_layers * per_layer + self.vocab_size * d
        return 6.0 * matmul + 6.0 * self.num_layers * h * k * seq_len

    @classmethod
    def preset(cls, name: str, model_type: str | None = None) -> LlamaConfig:
        return preset(name)

    # -- Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_hf(cls, data: dict[str, Any], source: str = "config.json") -> LlamaConfig:
        c = HFConfig(data, source)
        heads = c.get("num_attention_heads", int)
        hidden = c.get("hidden_size", int)
        try:
            rope = Rope.from_hf(data)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: rope settings: {e}") from None
        return cls(
            vocab_size=c.get("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=c.get("intermediate_size", int),
            num_layers=c.get("num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads", int, heads),
            head_dim=c.get("head_dim", int, hidden // heads),
            rms_norm_eps=c.get("rms_norm_eps", float, 1e-6),
            rope=rope,
            tie_word_embeddings=c.get("tie_word_embeddings", bool, False),
            max_position_embeddings=c.get("max_position_embeddings", int, 131072),
            initializer_range=c.get("initializer_range", float, 0.02),
            bos_token_id=c.get("bos_token_id", int, None),
            eos_token_id=c.get("eos_token_id", (int, list), None),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
            **self.rope.to_hf(),
        }


def _preset(**kw) -> LlamaConfig:
    return LlamaConfig(**kw)


PRESETS: dict[str, LlamaConfig] = {
    "llama3.1-8b": _preset(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, bos_token_id=128000, eos_token_id=128001,
    ),
    "llama3.1-70b": _preset(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, bos_token_id=128000, eos_token_id=128001,
    ),
    "llama3.1-405b": _preset(
        vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_layers=126,
        num_heads=128, num_kv_heads=8, head_dim=128, bos_token_id=128000, eos_token_id=128001,
    ),
    "llama3.2-1b": _preset(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rope=LLAMA32_ROPE, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "llama3.2-3b": _preset(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
        num_kv_heads=8, head_dim=128, rope=LLAMA32_ROPE, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001,
    ),
    # Byte-level models for tests and CPU training (vocab 256: one token per byte).
    "tiny": _preset(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16,
    ),
    "small": _preset(
        vocab_size=256, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
        num_kv_heads=4, head_dim=32,
    ),
    # The shared benchmark shape (benchmarks/README.md).
    "bench": _preset(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
        num_kv_heads=4, head_dim=64,
    ),
}  # fmt: skip


def preset(name: str) -> LlamaConfig:
    """A named configuration (``llama3.1-8b``, ``small``, ...)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown Llama preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
