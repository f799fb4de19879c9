"""A typed map from the names of a model's layer to a word of a small vocabulary, spelled on
the command line as presets and ``name=value`` pairs.

Two maps build on it: the placement map (:mod:`zoo.placement`: where each named tensor waits
for the backward pass) and the precision map (:mod:`zoo.precision`: which FP8 recipe each
matmul runs). Each family declares a frozen dataclass subclass with one field per name; the
subclass's ``values`` and builtin presets say what the fields may hold.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

# A TypeVar, not typing.Self: beartype (the test run's checker) refuses Self on classmethods.
M = TypeVar("M", bound="NameMap")


def choices(kind: str, word: str, options: tuple[str, ...] | list[str]) -> str:
    """``'quer' (did you mean 'query'?); valid names: ...`` for an error message."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{word!r}{suggestion}; valid {kind}: {', '.join(options)}"


def slot(default: str, *, refuse: Mapping[str, str] | None = None) -> Any:
    """A field that cannot take some values: ``refuse`` maps each such value to the reason,
    which the error quotes."""
    return dataclasses.field(default=default, metadata={"refuse": dict(refuse or {})})


@dataclass(frozen=True)
class NameMap:
    """Base of a typed name map: one field per name, each holding one of ``values``.

    A kind of map (``PlacementMap``) sets ``values``, ``value_word`` (the word for one value in
    errors), ``name_word`` (what the names name), ``error`` and ``builtin`` (preset name ->
    the value every field takes, or its default where the field refuses it). A family's map
    subclasses that with ``model=`` (its model class, or the dotted ``module.Class`` name) and
    may add ``presets``: name -> spec string (see :meth:`parse`).
    """

    model: ClassVar[str] = ""
    presets: ClassVar[Mapping[str, str]] = {}
    values: ClassVar[tuple[str, ...]] = ()
    value_word: ClassVar[str] = "value"
    name_word: ClassVar[str] = "name"
    error: ClassVar[type[ValueError]] = ValueError
    builtin: ClassVar[Mapping[str, str]] = {}

    # Values are validated in __post_init__ with errors that list the choices; skip the
    # generic type check of the jaxtyping import hook so every bad value is the map's error.
    __no_type_check__ = True

    def __init_subclass__(cls, *, model: type | str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if model is None:
            return
        cls.model = model if isinstance(model, str) else f"{model.__module__}.{model.__qualname__}"
        clash = set(cls.presets) & set(cls.builtin)
        if clash:
            raise cls.error(f"{cls.__name__}.presets: {sorted(clash)} are built-in presets and cannot be redefined")
        cls.registered(cls)

    @classmethod
    def registered(cls, subclass: type) -> None:
        """Called for each family's map as it is declared (a kind of map may keep a registry)."""

    def __post_init__(self) -> None:
        cls = type(self)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value not in cls.values:
                raise cls.error(
                    f"{cls.__name__}.{f.name}: unknown {cls.value_word} "
                    f"{choices(cls.value_word + 's', str(value), cls.values)}"
                )
            reason = f.metadata.get("refuse", {}).get(value)
            if reason:
                raise cls.error(f"{cls.__name__}.{f.name} cannot be {value!r}: {reason}")

    # -- the names ------------------------------------------------------------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every name the map holds, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...]:
        """The values ``name`` accepts."""
        refuse = cls._field(name).metadata.get("refuse", {})
        return tuple(p for p in cls.values if p not in refuse)

    @classmethod
    def _field(cls, name: str) -> dataclasses.Field:
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f
        raise cls.error(f"{cls.__name__} has no {cls.name_word} named {choices('names', name, cls.names())}")

    def placed(self, value: str) -> tuple[str, ...]:
        """The names given ``value``."""
        return tuple(n for n in self.names() if getattr(self, n) == value)

    def items(self) -> Iterator[tuple[str, str]]:
        """``(name, value)`` pairs in field order."""
        return ((n, getattr(self, n)) for n in self.names())

    def spec(self) -> str:
        """The full map as a spec string ``name=value,...`` (:meth:`parse` reads it back)."""
        return ",".join(f"{n}={p}" for n, p in self.items())

    # -- presets and parsing ----------------------------------------------------------
    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        return (*cls.builtin, *cls.presets)

    @classmethod
    def preset(cls: type[M], name: str) -> M:  # noqa: PYI019
        """A named map: a built-in preset or one of the class's ``presets``."""
        return cls._preset(name, ())

    @classmethod
    def parse(cls: type[M], spec: str) -> M:  # noqa: PYI019
        """Read a command-line / config spelling of a map.

        ``"a=v,b=w"`` (unlisted names keep the field defaults), a preset name, or a preset with
        overrides ``"preset+a=v"``.
        """
        return cls._parse(spec, ())

    @classmethod
    def _preset(cls, name: str, seen: tuple[str, ...]) -> Any:
        if name in cls.builtin:
            value = cls.builtin[name]
            return cls(**{n: value for n in cls.names() if value in cls.choices(n)})
        if name not in cls.presets:
            raise cls.error(f"{cls.__name__} has no preset {choices('presets', name, cls.preset_names())}")
        if name in seen:
            raise cls.error(f"{cls.__name__}.presets refer to each other in a cycle: {' -> '.join((*seen, name))}")
        return cls._parse(cls.presets[name], (*seen, name))

    @classmethod
    def _parse(cls, spec: str, seen: tuple[str, ...]) -> Any:
        word = cls.value_word
        if not isinstance(spec, str) or not spec.strip():
            raise cls.error(
                f"{cls.__name__}: empty {word} spec; give a preset ({', '.join(cls.preset_names())}) "
                f"and/or name={word} pairs"
            )
        parts = [p.strip() for p in spec.split("+")]
        if "=" not in parts[0]:
            base, parts = cls._preset(parts[0], seen), parts[1:]
        else:
            base = cls()
        overrides: dict[str, str] = {}
        for part in parts:
            for item in (i.strip() for i in part.split(",")):
                if "=" not in item:
                    preset = item in cls.preset_names()
                    hint = "a preset name may only come first" if preset else f"expected name={word}"
                    raise cls.error(f"{cls.__name__}: cannot read {item!r} in {spec!r}: {hint}")
                name, value = (s.strip() for s in item.split("=", 1))
                cls._field(name)
                if value not in cls.values:
                    raise cls.error(
                        f"{cls.__name__}: {name}={value}: unknown {word} {choices(word + 's', value, cls.values)}"
                    )
                if name in overrides:
                    raise cls.error(f"{cls.__name__}: {name!r} is given twice in {spec!r}")
                overrides[name] = value
        return dataclasses.replace(base, **overrides)
