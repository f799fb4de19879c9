"""Reading ``config.json`` fields with errors that name the file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zoo.errors import ConfigError

_MISSING = object()


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


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)
