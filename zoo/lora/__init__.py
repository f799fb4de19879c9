"""LoRA fine-tuning adapters (PEFT's format) for every family: :mod:`zoo.lora.adapter` (the
adapters, the adapted model, merge), :mod:`zoo.lora.dropout` (PEFT's ``lora_dropout`` while
training), :mod:`zoo.lora.peft` (``adapter_config.json`` and
``adapter_model.safetensors`` in and out) and :mod:`zoo.lora.nf4` (QLoRA's NF4 base, as
bitsandbytes stores it)."""

from zoo.lora.adapter import (
    ALL_LINEAR,
    Adapter,
    FrozenLayer,
    LayerUpdate,
    LoraConfig,
    LoraModel,
    base_model,
    check_trainable,
    delta,
    init,
    linear_weights,
    merge,
    param_specs,
    place_unstreamed,
    resolve_targets,
    trainable_labels,
    valid_targets,
)
from zoo.lora.dropout import dropout_key
from zoo.lora.peft import adapter_config, load_adapter, read_adapter_config, save_adapter

__all__ = [
    "ALL_LINEAR", "Adapter", "FrozenLayer", "LayerUpdate", "LoraConfig", "LoraModel", "adapter_config", "base_model", "check_trainable", "delta", "dropout_key", "init", "linear_weights",
    "load_adapter", "merge", "param_specs", "place_unstreamed", "read_adapter_config", "resolve_targets", "save_adapter", "trainable_labels",
    "valid_targets",
]  # fmt: skip
