"""LoRA adapters in PEFT's format, in and out: a directory with ``adapter_config.json`` (PEFT's
``LoraConfig``) and ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``
``[r, in]`` and ``.lora_B.weight`` ``[out, r]`` per adapted module), as ``peft``'s
``save_pretrained`` writes and ``PeftModel.from_pretrained`` reads it.

Each module's key comes from the parameter description's Hugging Face key (the one
``from_pretrained`` reads the base weight from) with ``.weight`` replaced, one per index of a
stacked axis (layers, experts), so every family maps without a table of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zoo.core.registry import family_of
from zoo.errors import CheckpointError, ConfigError
from zoo.hf.safetensors import SafetensorsFile, write_safetensors
from zoo.hf.stored import host_value
from zoo.lora.adapter import ALL_LINEAR, Adapter, LoraConfig, LoraModel, dims, resolve_targets
from zoo.lora.adapter import peft_key as _key

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT LoraConfig fields that change the adapted model, with the values zoo honours (their
# defaults): any other value is refused, naming the field. Fields not listed (bookkeeping such as
# ``inference_mode``, ``revision``, initialisation settings) do not change a loaded adapter.
_MUST_BE: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None,),
    "modules_to_save": (None, []),
    "layer_replication": (None,),
    "exclude_modules": (None, [], ""),
    "target_parameters": (None, []),
    "trainable_token_indices": (None,),
    "lora_bias": (False, None),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None,),
    "megatron_config": (None,),
}


def adapter_config(model: LoraModel, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT writes for ``model``'s adapters."""
    c = model.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": c.r,
        "lora_alpha": c.alpha,
        "lora_dropout": c.dropout,
        "target_modules": ALL_LINEAR if c.targets == (ALL_LINEAR,) else sorted(c.targets),
        "use_rslora": c.rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_adapter(model: LoraModel, path: str | Path, *, base_model_name_or_path: str | None = None) -> Path:
    """Write ``model``'s adapters into directory ``path`` as PEFT does (created if missing). With
    several processes every one calls it: each adapter's blocks are gathered from them all, and
    the first process writes the files."""
    if not isinstance(model, LoraModel):
        raise TypeError(f"save_adapter: a zoo.lora.LoraModel is needed, got {type(model).__name__}")
    path = Path(path)
    specs, sizes = family_of(model.base).param_specs(model.config), model.config.sizes
    tensors = []
    for name, adapter in sorted(model.adapters.items()):
        p = specs[name]
        a, b = host_value(adapter.a), host_value(adapter.b)
        for idx, key in p.hf_keys(sizes):
            module = key[: -len(".weight")]
            tensors += [(_key(module, "A"), np.ascontiguousarray(a[idx])), (_key(module, "B"), np.ascontiguousarray(b[idx]))]
    tensors.sort()
    if jax.process_index() != 0:
        return path
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(adapter_config(model, base_model_name_or_path), indent=2) + "\n")
    return path


def read_adapter_config(path: str | Path) -> tuple[LoraConfig, dict[str, Any]]:
    """The :class:`LoraConfig` of a PEFT adapter directory (and the raw JSON); a setting zoo
    cannot honour is refused, naming the field."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_FILE} (is this a PEFT adapter directory?)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    if raw.get("peft_type") != "LORA":
        raise ConfigError(f"{file}: peft_type {raw.get('peft_type')!r} is not supported (only 'LORA')")
    if raw.get("task_type") not in ("CAUSAL_LM", None):
        raise ConfigError(f"{file}: task_type {raw['task_type']!r} is not supported (only 'CAUSAL_LM')")
    for field, allowed in _MUST_BE.items():
        if field in raw and raw[field] not in allowed:
            raise ConfigError(f"{file}: {field}={raw[field]!r} is not supported by zoo.lora "
                              f"(supported: {' or '.join(map(repr, allowed))})")  # fmt: skip
    targets = raw.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise ConfigError(f"{file}: target_modules {targets!r} is a regular expression; zoo.lora takes a list of "
                          "module names (or 'all-linear')")  # fmt: skip
    if not (targets == "all-linear" or (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets))):
        raise ConfigError(f"{file}: target_modules must be a non-empty list of module names, got {targets!r}")
    r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    try:
        config = LoraConfig(r=r, alpha=alpha, targets=("all-linear",) if targets == "all-linear" else tuple(targets),
                            rslora=bool(raw.get("use_rslora", False)), dropout=float(raw.get("lora_dropout", 0.0)))  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None
    return config, raw


def load_adapter(model: Any, path: str | Path) -> LoraModel:
    """``model`` (a base model of any family) with the PEFT adapter in directory ``path``: every
    module its ``target_modules`` name must have its ``lora_A`` / ``lora_B`` (``[r, in]``,
    ``[out, r]``), and the file nothing else. The adapters are float32."""
    path = Path(path)
    config, _ = read_adapter_config(path)
    family = family_of(model)
    specs, sizes = family.param_specs(model.config), model.config.sizes
    try:
        chosen = resolve_targets(specs, config.targets, family.__name__, field="target_modules")
    except ConfigError as e:
        raise ConfigError(f"{path / CONFIG_FILE}: {e}") from None
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise CheckpointError(f"{path}: no {WEIGHTS_FILE}")
    st = SafetensorsFile(file)
    unused = set(st.keys())
    adapters = {}
    for name, p in chosen.items():
        stacked, n_out, n_in = dims(p, sizes)
        a = np.empty((*stacked, config.r, n_in), np.float32)
        b = np.empty((*stacked, n_out, config.r), np.float32)
        for idx, key in p.hf_keys(sizes):
            module = key[: -len(".weight")]
            for which, out, shape in (("A", a, (config.r, n_in)), ("B", b, (n_out, config.r))):
                k = _key(module, which)
                if k not in unused:
                    raise CheckpointError(f"{file}: no tensor {k!r} (target_modules {list(config.targets)} names "
                                          f"module {module!r})")  # fmt: skip
                t = st.get(k)
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"{file}: {k} has shape {tuple(t.shape)}, expected {list(shape)} "
                                          f"(r={config.r})")  # fmt: skip
                out[idx] = t.astype(np.float32)
                unused.discard(k)
        adapters[name] = Adapter(a=jnp.asarray(a), b=jnp.asarray(b))
    if unused:
        shown = sorted(unused)[:5]
        raise CheckpointError(f"{file}: {len(unused)} tensors zoo.lora does not load (not a lora_A / lora_B of the "
                              f"modules target_modules names in {family.__name__}), e.g. {shown}")  # fmt: skip
    return LoraModel(base=model, adapters=adapters, lora=config)
