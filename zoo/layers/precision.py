"""Which matmuls run in FP8, and in which recipe: a family's typed *precision map*.

A precision map is a frozen dataclass with one field per matmul of a decoder layer, named as
the placement map names the matmul's output where the two coincide (``query``, ``mlp_up``);
each field holds a recipe of :mod:`zoo.layers.fp8` (``"none"``, ``"tensorwise"``,
``"mxfp8"``, ``"blockwise"``). Each family declares its map in its own folder
(``zoo/llama/precision.py``) and names it as its model class's ``precision_map``::

    @dataclass(frozen=True)
    class LlamaPrecision(PrecisionMap, model="zoo.llama.model.Llama"):
        query: Recipe = "none"
        ...

Built-in presets: ``none`` (every matmul as written), ``fp8_all`` (tensorwise current
scaling everywhere), ``mxfp8`` and ``blockwise`` (that recipe everywhere); a family adds its
own (DeepSeek-V3's ``deepseek``). Spec strings as the placement map's: ``"fp8_all"``,
``"mxfp8+mlp_down=none"``, ``"query=tensorwise,value=tensorwise"``. What a map never names
stays in the model's dtype: the router, attention's scores and context, norms, the embedding
and the loss head.

:func:`using` makes a map active while the step is traced; model code calls
:func:`zoo.layers.fp8.matmul` with each matmul's name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from zoo.core.name_map import NameMap
from zoo.errors import ConfigError
from zoo.layers import fp8
from zoo.layers.fp8 import RECIPES, Recipe

__all__ = ["PrecisionError", "PrecisionMap", "Recipe", "precision_map_for", "resolve", "using"]


class PrecisionError(ConfigError):
    """A precision map or spec names an unknown matmul or recipe, or is another model's."""


@dataclass(frozen=True)
class PrecisionMap(NameMap):
    """Base of every model's precision map: one :data:`~zoo.layers.fp8.Recipe` field per matmul."""

    values: ClassVar[tuple[str, ...]] = RECIPES
    value_word: ClassVar[str] = "recipe"
    name_word: ClassVar[str] = "matmul"
    error: ClassVar[type[ValueError]] = PrecisionError
    builtin: ClassVar[Mapping[str, str]] = {
        "none": "none",
        "fp8_all": "tensorwise",
        "tensorwise": "tensorwise",
        "mxfp8": "mxfp8",
        "blockwise": "blockwise",
    }

    def recipes(self) -> dict[str, str]:
        """``{matmul name: recipe}``, what :func:`zoo.layers.fp8.using` takes."""
        return dict(self.items())


def precision_map_for(model: Any) -> type[PrecisionMap]:
    """The precision map class of ``model``'s family (an instance or class)."""
    cls = model if isinstance(model, type) else type(model)
    found = getattr(cls, "precision_map", None)
    if isinstance(found, type) and issubclass(found, PrecisionMap):
        return found
    raise PrecisionError(
        f"{cls.__name__} declares no precision map, so none of its matmuls can run in FP8; give its class a "
        "precision_map: a frozen dataclass subclassing zoo.layers.precision.PrecisionMap"
    )


def resolve(precision: PrecisionMap | str, model: Any) -> PrecisionMap:
    """``precision`` as the model's map: a spec string is parsed with the model's map class; a
    map must be of that class."""
    cls = precision_map_for(model)
    if isinstance(precision, str):
        return cls.parse(precision)
    if not isinstance(precision, cls):
        raise PrecisionError(
            f"precision for a {type(model).__name__} must be a {cls.__name__} or a spec string; "
            f"got {type(precision).__name__}"
        )
    return precision


@contextlib.contextmanager
def using(precision: PrecisionMap | str | None, model: Any) -> Iterator[None]:
    """Trace the enclosed model code with ``model``'s precision map ``precision`` active;
    ``None`` or a map of all ``"none"``: every matmul as written.

    Enter it inside the function that is jitted, as :func:`zoo.train.make_train_step` does:
    ``jax.jit`` caches a trace by its arguments, not by the map active around the call."""
    if precision is None:
        yield
        return
    with fp8.using(resolve(precision, model).recipes()):
        yield
