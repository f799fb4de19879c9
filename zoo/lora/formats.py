"""QLoRA's base formats by name (``--qlora``), and a PEFT adapter merged into a model quantized
as the adapter's QLoRA run had it."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from zoo.core.protocol import CausalLM
from zoo.errors import ConfigError
from zoo.lora import fp8, int8, nf4
from zoo.lora.adapter import merge
from zoo.lora.peft import load_adapter

QUANTIZED: dict[str, ModuleType] = {"nf4": nf4, "int8": int8, "fp8": fp8}  # each has quantize_model and from_pretrained


def format_module(name: str) -> ModuleType:
    if name not in QUANTIZED:
        raise ConfigError(f"unknown quantized format {name!r}: one of {sorted(QUANTIZED)}")
    return QUANTIZED[name]


def merged_adapter(model: CausalLM, directory: str | Path, *, quantized: str | None = None) -> CausalLM:
    """``model`` with the PEFT adapter in ``directory`` merged in; ``quantized`` (``"nf4"``, ``"fp8"``,
    ``"int8"``): onto its layer stacks quantized first, as a QLoRA run trained the adapter (the
    merge dequantizes them: the model it gives is the one that run's steps computed)."""
    base = model if quantized is None else format_module(quantized).quantize_model(model)
    return merge(load_adapter(base, directory))
