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

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, get_args

import jax

from zoo.core import name_map
from zoo.core.name_map import NameMap, choices
from zoo.core.registry import families

Placement = Literal["device", "remat", "pinned_host"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
BUILTIN_PRESETS: tuple[str, ...] = ("device", "remat")

T = TypeVar("T")


class PlacementError(ValueError):
    """A placement map, spec string or tree placement names an unknown tensor, an unknown
    placement, a choice the mechanism cannot honour, or a map of another model."""


_choices = choices  # the old private name


def slot(default: Placement = "device", *, refuse: Mapping[str, str] | None = None) -> Any:
    """A placement field whose tensor cannot take some placements: ``refuse`` maps each such
    placement to the reason, which the error quotes."""
    return name_map.slot(default, refuse=refuse)


_MAPS: dict[str, type[PlacementMap]] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class PlacementMap(NameMap):
    """Base of every model's placement map: one :data:`Placement` field per named tensor.

    Subclass with ``model=`` (the model class, or its dotted ``module.Class`` name) to
    register the map for that model; ``presets`` maps preset names to spec strings (see
    :meth:`parse`), on top of the built-in ``device`` (everything saved) and ``remat``
    (everything recomputed that can be). Parsing and presets: :class:`zoo.core.name_map.NameMap`.
    """

    values: ClassVar[tuple[str, ...]] = PLACEMENTS
    value_word: ClassVar[str] = "placement"
    name_word: ClassVar[str] = "tensor"
    error: ClassVar[type[ValueError]] = PlacementError
    builtin: ClassVar[Mapping[str, str]] = {"device": "device", "remat": "remat"}

    @classmethod
    def registered(cls, subclass: type) -> None:
        _MAPS[subclass.model] = subclass

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every named tensor of the model's layer, in data-flow order."""
        return super().names()

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
    """The placement map class of ``model``'s family (an instance or class): its ``placement_map``
    (an instance's own, where a wrapper takes its base model's: ``zoo.lora.LoraModel``)."""
    cls = model if isinstance(model, type) else type(model)
    found = getattr(model, "placement_map", None)
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
