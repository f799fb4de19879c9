"""The model families zoo knows: one line per family in :data:`FAMILY_PACKAGES`.

A family package registers its model class (a :class:`zoo.core.protocol.CausalLM`) when imported;
everything generic finds a family here, by Hugging Face ``model_type``, by model or by config.
The registry sits below the protocol (the protocol's ``num_params`` asks it for the family), so
it checks a class by the attributes the protocol declares, not by importing it.
"""

from __future__ import annotations

import importlib
from typing import Any

from zoo.errors import ConfigError

# The family packages, imported on first use. Adding a family is adding its line.
FAMILY_PACKAGES: tuple[str, ...] = (
    "zoo.llama",
    "zoo.deepseek_v3",
    "zoo.qwen3",
)

_BY_MODEL_TYPE: dict[str, type] = {}
_loaded = False


def register(model_cls: type) -> type:
    """Make ``model_cls`` (a concrete :class:`~zoo.core.protocol.CausalLM`) loadable by its
    ``model_types`` and findable from its instances and configs. Returns it (a decorator too)."""
    protocol = ("model_types", "config_cls", "param_specs", "forward", "placement_map")
    if not (isinstance(model_cls, type) and all(hasattr(model_cls, a) for a in protocol)):
        raise TypeError(f"register: {model_cls!r} is not a zoo.core.protocol.CausalLM subclass")
    for model_type in model_cls.model_types:
        other = _BY_MODEL_TYPE.get(model_type)
        if other is not None and other is not model_cls:
            raise ValueError(f"register: model_type {model_type!r} is already {other.__name__}'s")
        _BY_MODEL_TYPE[model_type] = model_cls
    return model_cls


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for name in FAMILY_PACKAGES:
            importlib.import_module(name)


def families() -> tuple[type, ...]:
    """Every registered model class, once each, in registration order."""
    _load()
    return tuple(dict.fromkeys(_BY_MODEL_TYPE.values()))


def model_types() -> list[str]:
    _load()
    return sorted(_BY_MODEL_TYPE)


def by_model_type(model_type: str, source: str = "config.json") -> type:
    """The model class that loads ``model_type``; a :class:`ConfigError` naming the choices."""
    _load()
    if model_type not in _BY_MODEL_TYPE:
        raise ConfigError(f"{source}: unknown model_type {model_type!r}; zoo supports {model_types()}")
    return _BY_MODEL_TYPE[model_type]


def family_of(obj: Any) -> type:
    """The model class of a model (instance or class) or of a config instance."""
    _load()
    for cls in families():
        if isinstance(obj, (cls, cls.config_cls)) or (isinstance(obj, type) and issubclass(obj, cls)):
            return cls
    raise TypeError(f"{type(obj).__name__} is not a registered zoo model or config (families: {[c.__name__ for c in families()]})")


def is_model(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a registered model class."""
    _load()
    return any(isinstance(obj, cls) for cls in families())
