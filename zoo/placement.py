"""Where things live during training: ``device``, ``remat`` or ``pinned_host``.

Activations. Every intermediate of a decoder layer that the backward pass may need carries a
name (``jax.ad_checkpoint.checkpoint_name``). A model's *placement map* is a frozen dataclass
with one field per name (``LlamaPlacement`` for Llama); each field says where that
tensor waits for the backward pass:

- ``"device"``: saved in accelerator memory,
- ``"remat"``: dropped and recomputed in the backward pass from what is saved,
- ``"pinned_host"``: copied to pinned host memory in the forward pass, copied back for the
  backward pass (XLA overlaps the copies with compute on GPU).

The map compiles to a ``jax.checkpoint`` policy for the scanned layer body (:func:`layer_policy`).
Anything unnamed inside the layer is recomputed as soon as a map is given. ``placement=None``
(the default everywhere) applies no ``jax.checkpoint`` at all: XLA keeps whatever the
backward pass uses, attention probabilities included. Placement never changes numerics.

Each family declares its map in its own folder (``zoo/llama/placement.py``) and names it as
its model class's ``placement_map``::

    @dataclass(frozen=True)
    class LlamaPlacement(PlacementMap, model="zoo.llama.model.Llama"):
        presets: ClassVar[Mapping[str, str]] = {"save_matmuls": "remat+query=device,..."}
        query: Placement = "device"
        ...

Parameters and optimizer state. :func:`tree_placement` moves whole trees between device and
pinned host memory (sharding kept); :func:`zoo.train.make_train_step` (``param_memory``,
``opt_memory``) builds a step whose parameters and/or optimizer state live in pinned host
memory between steps and are brought to device inside it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, get_args

import jax

from zoo.core.registry import families

Placement = Literal["device", "remat", "pinned_host"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
BUILTIN_PRESETS: tuple[str, ...] = ("device", "remat")

M = TypeVar("M", bound="PlacementMap")
T = TypeVar("T")


class PlacementError(ValueError):
    """A placement map, spec string or tree placement names an unknown tensor, an unknown
    placement, a choice the mechanism cannot honour, or a map of another model."""


def _choices(kind: str, word: str, choices: tuple[str, ...] | list[str]) -> str:
    """``'quer' (did you mean 'query'?); valid names: ...`` for an error message."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{word!r}{suggestion}; valid {kind}: {', '.join(choices)}"


def slot(default: Placement = "device", *, refuse: Mapping[str, str] | None = None) -> Any:
    """A placement field whose tensor cannot take some placements: ``refuse`` maps each such
    placement to the reason, which the error quotes."""
    return dataclasses.field(default=default, metadata={"refuse": dict(refuse or {})})


_MAPS: dict[str, type[PlacementMap]] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class PlacementMap:
    """Base of every model's placement map: one :data:`Placement` field per named tensor.

    Subclass with ``model=`` (the model class, or its dotted ``module.Class`` name) to
    register the map for that model; ``presets`` maps preset names to spec strings (see
    :meth:`parse`), on top of the built-in ``device`` (everything saved) and ``remat``
    (everything recomputed that can be).
    """

    model: ClassVar[str] = ""
    presets: ClassVar[Mapping[str, str]] = {}

    # Values are validated in __post_init__ with errors that list the choices; skip the
    # generic type check of the jaxtyping import hook so every bad value is a PlacementError.
    __no_type_check__ = True

    def __init_subclass__(cls, *, model: type | str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if model is None:
            return
        cls.model = model if isinstance(model, str) else _qualname(model)
        clash = set(cls.presets) & set(BUILTIN_PRESETS)
        if clash:
            raise PlacementError(
                f"{cls.__name__}.presets: {sorted(clash)} are built-in presets and cannot be redefined"
            )
        _MAPS[cls.model] = cls

    def __post_init__(self) -> None:
        cls = type(self)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value not in PLACEMENTS:
                raise PlacementError(
                    f"{cls.__name__}.{f.name}: unknown placement {_choices('placements', str(value), PLACEMENTS)}"
                )
            reason = f.metadata.get("refuse", {}).get(value)
            if reason:
                raise PlacementError(f"{cls.__name__}.{f.name} cannot be {value!r}: {reason}")

    # -- the names ------------------------------------------------------------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every named tensor of the model's layer, in data-flow order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def choices(cls, name: str) -> tuple[str, ...]:
        """The placements tensor ``name`` accepts."""
        refuse = cls._field(name).metadata.get("refuse", {})
        return tuple(p for p in PLACEMENTS if p not in refuse)

    @classmethod
    def _field(cls, name: str) -> dataclasses.Field:
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f
        raise PlacementError(f"{cls.__name__} has no tensor named {_choices('names', name, cls.names())}")

    def placed(self, placement: Placement) -> tuple[str, ...]:
        """The names given ``placement``."""
        return tuple(n for n in self.names() if getattr(self, n) == placement)

    def items(self) -> Iterator[tuple[str, str]]:
        """``(name, placement)`` pairs in field order."""
        return ((n, getattr(self, n)) for n in self.names())

    def spec(self) -> str:
        """The full map as a spec string ``name=placement,...`` (:meth:`parse` reads it back)."""
        return ",".join(f"{n}={p}" for n, p in self.items())

    # -- presets and parsing ----------------------------------------------------------
    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        return (*BUILTIN_PRESETS, *cls.presets)

    @classmethod
    def preset(cls, name: str) -> M:
        """A named map: ``device``, ``remat`` or one of the class's ``presets``."""
        return cls._preset(name, ())

    @classmethod
    def parse(cls, spec: str) -> M:
        """Read a command-line / config spelling of a map.

        ``"query=pinned_host,mlp_up=remat"`` (unlisted names keep the field defaults), a preset
        name ``"save_matmuls"``, or a preset with overrides ``"remat+query=pinned_host"``.
        """
        return cls._parse(spec, ())

    @classmethod
    def _preset(cls, name: str, seen: tuple[str, ...]) -> M:
        if name == "device":
            return cls(**{n: "device" for n in cls.names()})
        if name == "remat":
            return cls(**{n: "remat" if "remat" in cls.choices(n) else "device" for n in cls.names()})
        if name not in cls.presets:
            raise PlacementError(f"{cls.__name__} has no preset {_choices('presets', name, cls.preset_names())}")
        if name in seen:
            raise PlacementError(f"{cls.__name__}.presets refer to each other in a cycle: {' -> '.join((*seen, name))}")
        return cls._parse(cls.presets[name], (*seen, name))

    @classmethod
    def _parse(cls, spec: str, seen: tuple[str, ...]) -> M:
        if not isinstance(spec, str) or not spec.strip():
            raise PlacementError(
                f"{cls.__name__}: empty placement spec; give a preset ({', '.join(cls.preset_names())}) "
                "and/or name=placement pairs"
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
                    hint = "a preset name may only come first" if preset else "expected name=placement"
                    raise PlacementError(f"{cls.__name__}: cannot read {item!r} in {spec!r}: {hint}")
                name, value = (s.strip() for s in item.split("=", 1))
                cls._field(name)
                if value not in PLACEMENTS:
                    raise PlacementError(
                        f"{cls.__name__}: {name}={value}: unknown placement {_choices('placements', value, PLACEMENTS)}"
                    )
                if name in overrides:
                    raise PlacementError(f"{cls.__name__}: {name!r} is given twice in {spec!r}")
                overrides[name] = value
        return dataclasses.replace(base, **overrides)

    # -- compiling ------------------------------------------------------------------
    def policy(self) -> Callable[..., Any]:
        """The ``jax.checkpoint`` policy: save the ``device`` names, offload the
        ``pinned_host`` names, recompute everything else."""
        return _policy(self.placed("device"), self.placed("pinned_host"))


@functools.cache
def _policy(saved: tuple[str, ...], offloaded: tuple[str, ...]) -> Callable[..., Any]:
    # Cached so equal maps give the identical policy object (and so identical jaxprs).
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )


LAYER_INPUT_REMAT = (
    "the layer input is the scan carry, the argument of the checkpointed layer body; the body "
    "cannot recompute it, so jax.checkpoint keeps it on device whatever the policy says "
    "('remat' would silently mean 'device'). Choose 'device' or 'pinned_host'."
)


def layer_input_slot() -> Any:
    """The field of a layer's input (the scan carry): ``device`` or ``pinned_host``, never ``remat``."""
    return slot(refuse={"remat": LAYER_INPUT_REMAT})


def placement_map_for(model: Any) -> type[PlacementMap]:
    """The placement map class of ``model``'s family (an instance or class): its ``placement_map``."""
    cls = model if isinstance(model, type) else type(model)
    found = getattr(cls, "placement_map", None)
    if isinstance(found, type) and issubclass(found, PlacementMap):
        return found
    for t in cls.__mro__:  # a map declared with model=<class> for a class outside the registry
        if _qualname(t) in _MAPS:
            return _MAPS[_qualname(t)]
    raise PlacementError(
        f"no placement map is registered for {cls.__name__} ({_qualname(cls)}); give its class a placement_map: "
        f"a frozen dataclass subclassing zoo.placement.PlacementMap. Registered: {sorted(_MAPS)}"
    )


def __getattr__(name: str) -> type[PlacementMap]:
    # The families' maps lived here before each moved to its family's folder
    # (``from zoo.placement import LlamaPlacement`` keeps working).
    for cls in families():
        found = getattr(cls, "placement_map", None)
        if found is not None and found.__name__ == name:
            return found
    raise AttributeError(f"module 'zoo.placement' has no attribute {name!r}")


def resolve(placement: PlacementMap | str, model: Any) -> PlacementMap:
    """``placement`` as the model's map: a spec string is parsed with the model's map class;
    a map must be of that class."""
    cls = placement_map_for(model)
    if isinstance(placement, str):
        return cls.parse(placement)
    if not isinstance(placement, PlacementMap):
        raise TypeError(
            f"placement for a {type(model).__name__} must be a {cls.__name__}, a spec string or None; "
            f"got {type(placement).__name__}"
        )
    if not isinstance(placement, cls):
        owner = placement.model.rsplit(".", 1)[-1] or "no model"
        raise PlacementError(
            f"a {type(placement).__name__} places the tensors of {owner}, not of a {type(model).__name__}; "
            f"use {cls.__name__}"
        )
    return placement


def layer_policy(placement: PlacementMap | str | None, model: Any) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy for ``model``'s scanned layer body; ``None`` means no
    ``jax.checkpoint`` (XLA keeps whatever the backward pass uses)."""
    if placement is None:
        return None
    return resolve(placement, model).policy()


def named_tensors(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[tuple[str, jax.ShapeDtypeStruct]]:
    """Every ``checkpoint_name`` in the program ``fn(*args, **kwargs)`` traces to, with the
    named tensor's shape and dtype, once per occurrence, nested jaxprs (scan, remat, cond,
    custom rules, jit) included. Tracing only: nothing is compiled or run."""
    return names_in(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)


def names_in(jaxpr: Any) -> list[tuple[str, jax.ShapeDtypeStruct]]:
    """:func:`named_tensors` of a traced program's jaxpr (``jax.jit(f).trace(...).jaxpr``); inside a
    ``shard_map`` the shapes are each device's."""
    found: list[tuple[str, jax.ShapeDtypeStruct]] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name":
                aval = eqn.outvars[0].aval
                found.append((eqn.params["name"], jax.ShapeDtypeStruct(aval.shape, aval.dtype)))
            for sub in subjaxprs(eqn):
                walk(sub)

    walk(getattr(jaxpr, "jaxpr", jaxpr))
    return found


def subjaxprs(eqn: Any) -> Iterator[Any]:
    """The jaxprs ``eqn`` holds (a scan's body, a call's, a cond's branches), in parameter order.
    A loop, not a nested function: called on every equation of a traced step, a nested def is
    re-instrumented per call under the test suite's jaxtyping import hook (seconds per trace)."""
    todo = list(reversed(eqn.params.values()))
    while todo:
        v = todo.pop()
        if hasattr(v, "eqns") and hasattr(v, "outvars"):
            yield v
        elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
            yield v.jaxpr
        elif isinstance(v, (tuple, list)):
            todo.extend(reversed(v))


_subjaxprs = subjaxprs  # the old private name, for code written before it was public


# -- parameters and optimizer state --------------------------------------------------

_TREE_REMAT = (
    "{what} cannot be 'remat': it is an input of the training step, not computed from one. "
    "Choose 'device' or 'pinned_host'."
)


def memory_space(placement: str, what: str) -> jax.memory.Space:
    """The memory space a whole tree (``what``: "parameters", "optimizer state") lives in
    between steps; ``remat`` or an unknown word is a :class:`PlacementError` naming both."""
    if placement == "device":
        return jax.memory.Space.Device
    if placement == "pinned_host":
        return jax.memory.Space.Host
    if placement == "remat":
        raise PlacementError(_TREE_REMAT.format(what=what))
    valid = ("device", "pinned_host")
    raise PlacementError(f"{what}: unknown placement {_choices('placements', str(placement), valid)}")


def tree_placement(tree: T, placement: Placement, *, what: str = "a tree") -> T:
    """Every array leaf of ``tree`` moved to device or pinned host memory, its sharding kept.

    Works outside ``jit`` (a transfer) and inside it (an annotation XLA turns into copies).
    """
    space = memory_space(placement, what)
    return jax.tree.map(lambda x: jax.device_put(x, space) if isinstance(x, jax.Array) else x, tree)


def memory_kinds(tree: Any) -> set[str]:
    """The memory kinds holding the array leaves of ``tree`` (``{"pinned_host"}``, ...)."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)}
