"""Llama 3.x hyper-parameters, presets, FLOP and parameter counts, and the HF ``config.json`` mapping."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from zoo.core.protocol import AxisRule
from zoo.errors import ConfigError
from zoo.hf.config import HFConfig, decoder_hf
from zoo.layers.decoder import GQAConfig
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
class LlamaConfig(GQAConfig):
    """Architecture of a Llama 3.x decoder. Field names follow Hugging Face's where they exist
    (the shared ones, from ``vocab_size`` to ``head_dim`` and the keyword-only ``tie_word_embeddings``,
    ``initializer_range``, special tokens, ``attention`` and ``hf_extra``: :class:`GQAConfig`)."""

    axis_rules: ClassVar[dict[str, AxisRule]] = LLAMA_AXES

    rms_norm_eps: float = 1e-5
    rope: Rope = field(default_factory=lambda: LLAMA3_ROPE)
    max_position_embeddings: int = 131072

    @property
    def own_sizes(self) -> dict[str, int]:
        return {"L": self.num_layers, "H": self.num_heads, "G": self.num_kv_heads, "K": self.head_dim}

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
        shared = c.decoder_fields(max_position_embeddings=131072)
        heads = shared["num_heads"]
        return cls(
            **shared,
            num_kv_heads=c.get("num_key_value_heads", int, heads),
            head_dim=c.get("head_dim", int, shared["hidden_size"] // heads),
            rope=c.parsed("rope settings", Rope.from_hf),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **decoder_hf(self),
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "mlp_bias": False,
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
