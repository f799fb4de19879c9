"""Reading ``config.json`` fields with errors that name the file and field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from zoo.errors import ConfigError

_MISSING = object()
T = TypeVar("T")


class HFConfig:
    """A parsed ``config.json`` with typed, named access to its fields."""

    def __init__(self, data: dict[str, Any], source: str | Path = "config.json"):
        self.data = data
        self.source = str(source)

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        """Field ``name`` as ``kind``; ``default`` when absent or null (required if no default)."""
        value = self.data.get(name, None)
        if value is None:
            if default is _MISSING:
                raise ConfigError(f"{self.source}: required field {name!r} is missing")
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{self.source}: field {name!r} must be {_names(kinds)}, got {value!r}")
        if not isinstance(value, kinds):
            raise ConfigError(
                f"{self.source}: field {name!r} must be {_names(kinds)}, got {type(value).__name__} {value!r}"
            )
        return value

    def parsed(self, what: str, parse: Callable[[dict[str, Any]], T]) -> T:
        """``parse(data)`` (a rope rule from its fields), its ``TypeError`` or ``ValueError`` a
        :class:`ConfigError` naming the file and ``what``."""
        try:
            return parse(self.data)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{self.source}: {what}: {e}") from None

    def decoder_fields(self, *, max_position_embeddings: int) -> dict[str, Any]:
        """What every decoder family reads alike, under zoo's field names: the sizes Hugging Face
        names alike, the norm's epsilon, head tying, the context length (default
        ``max_position_embeddings``), the init scale and the special tokens."""
        return {
            "vocab_size": self.get("vocab_size", int),
            "hidden_size": self.get("hidden_size", int),
            "intermediate_size": self.get("intermediate_size", int),
            "num_layers": self.get("num_hidden_layers", int),
            "num_heads": self.get("num_attention_heads", int),
            "rms_norm_eps": self.get("rms_norm_eps", float, 1e-6),
            "tie_word_embeddings": self.get("tie_word_embeddings", bool, False),
            "max_position_embeddings": self.get("max_position_embeddings", int, max_position_embeddings),
            "initializer_range": self.get("initializer_range", float, 0.02),
            "bos_token_id": self.get("bos_token_id", int, None),
            "eos_token_id": self.get("eos_token_id", (int, list), None),
        }


def decoder_hf(config: Any) -> dict[str, Any]:
    """The ``config.json`` fields every decoder family writes alike: those
    :meth:`HFConfig.decoder_fields` reads, SwiGLU's activation and no attention biases."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "attention_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)
