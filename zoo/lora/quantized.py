"""QLoRA's frozen base: the layer stacks' linear weights stored quantized, one stored matrix
per stacked index in its checkpoint's ``[out, in]`` layout, dequantized a layer at a time where
the layer scan reads them (:class:`zoo.core.params.Deferred`). The formats:
:mod:`zoo.lora.nf4` (NF4 with double quantization, as bitsandbytes' 4-bit) and
:mod:`zoo.lora.int8` (row-wise absmax int8, as bitsandbytes' LLM.int8).

Dimension letters: ``S`` a weight's stacked axes (layers, experts), ``v`` its stored values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Float32

from zoo.core.layout import CODES, is_layer_stack, param_axes
from zoo.core.mesh import axis_names
from zoo.core.named import named
from zoo.core.params import Deferred, Param, map_params
from zoo.core.protocol import CausalLM
from zoo.core.registry import family_of
from zoo.hf.load import from_pretrained
from zoo.hf.stored import host_value
from zoo.hooks.step import GATHERED, block_of, current_step
from zoo.lora.adapter import linear_weights, module_of, on_device


class QuantizedWeight(Deferred):
    """A layer stack's frozen linear weight in a quantized format: its arrays (codes and
    scales, stacked as the weight is) and what lays the dequantized values out as the family
    holds the weight. A format implements :meth:`stored_values`, and names in :attr:`split` its
    bulk, the codes: stored split over the mesh (:data:`zoo.core.layout.CODES`) and gathered a
    layer at a time."""

    param: Param = eqx.field(static=True)  # the weight's description (its layout and checkpoint letters)
    sizes: tuple[tuple[str, int], ...] = eqx.field(static=True)  # the config's dimension sizes
    dtype: str = eqx.field(static=True)  # the weight's dtype, dequantized
    format: ClassVar[str]
    # field -> (its dimensions past the stacked ones, the first's size for one stored [out, in]
    # matrix): the field is split over the mesh on that first dimension, where it divides.
    split: ClassVar[Mapping[str, tuple[int, Callable[[int, int], int]]]] = {}

    def stored_values(self) -> Float32[Array, "*S v"]:
        """The dequantized values of each stored matrix, row-major, stacked axes first."""
        raise NotImplementedError

    def value(self) -> Float[Array, "*dims"]:
        """One layer's weight (the layer axis gone; any view's leading axes kept); inside the
        parallel step, the block of it this device holds (the codes are split over the mesh as
        the weight's stacked letters are and, on their own dimension, over the axes that split
        the weight's features: gathered whole here, then dequantized)."""
        flat = self._gathered(jax.lax.stop_gradient(on_device(self))).stored_values()
        sizes, p = dict(self.sizes), self.param
        names = p.names[1:]
        stacked = [a for a in p.stacked if a in names]
        order = stacked + [a for g in p.hf_groups() for a in g]
        lead = flat.shape[: flat.ndim - 1 - len(stacked)]
        # (the stacked letters' sizes as held: the experts' may be this device's block of them)
        w = flat.reshape(*flat.shape[:-1], *(sizes[a] for a in order[len(stacked) :]))
        w = w.transpose([*range(len(lead)), *(len(lead) + order.index(a) for a in names)])
        return _laid_out(w.astype(self.dtype), p, sizes)

    def field_params(self) -> dict[str, Param]:
        """Frozen, and not in checkpoints (a quantized base is made from one): laid out on a mesh
        by the weight's stacked letters (its checkpoint key's, here with the field's name), the
        codes (:attr:`split`) on :data:`~zoo.core.layout.CODES` too, the rest of each array whole."""
        out = {}
        for f in (f.name for f in dataclasses.fields(self) if not f.metadata.get("static")):
            inner = max(np.ndim(getattr(self, f)) - len(self.param.stacked), 0)  # (a planner's skeleton: scalars)
            out[f] = self._field_param(f, inner)
        return out

    def _field_param(self, f: str, inner: int) -> Param:
        p = self.param
        letters = [f"{f}{i}" for i in range(inner)]
        own: tuple[tuple[str, int], ...] = ()
        if f in self.split and inner == self.split[f][0]:
            letters[0] = CODES
            own = ((CODES, self.split[f][1](*p.hf_shape(dict(self.sizes)))),)
        return Param(axes=" ".join([*p.stacked, *letters]), hf=f"{p.hf[: -len('.weight')]}.{f}", init="zeros",
                     trainable=False, own_sizes=own)  # fmt: skip

    def _gathered(self, held: QuantizedWeight) -> QuantizedWeight:
        """``held`` (this layer's slice), inside the parallel step with its codes gathered whole
        from the devices that split them (never saved for the backward pass: gathered again)."""
        step = current_step()
        if step is None:
            return held
        for f, (inner, _) in self.split.items():
            p = self._field_param(f, inner)
            axes = axis_names(param_axes(p, step.mesh, rules=step.rules, sizes=dict(self.sizes))[len(p.stacked)])
            if axes:
                x = getattr(held, f)
                whole = named(GATHERED, jax.lax.all_gather, x, axes, axis=x.ndim - inner, tiled=True)
                held = dataclasses.replace(held, **{f: whole})
        return held


# A format: (quantize one stored matrix [out, in] -> its arrays, the arrays' shapes and dtypes
# for one of [out, in], and its weight class).
Quantize = Callable[[np.ndarray, str], dict[str, np.ndarray]]
Shapes = Callable[[tuple[int, int], str], dict[str, tuple[tuple[int, ...], object]]]


def quantize_stacks(model: CausalLM, quantize: Quantize, shapes: Shapes, weight: Callable[..., QuantizedWeight],
                    keep: tuple[str, ...] = ()) -> CausalLM:  # fmt: skip
    """``model`` with every linear weight of its layer stacks (those a LoRA target may name:
    :func:`zoo.lora.linear_weights`) quantized, a stored matrix at a time, but the modules named
    in ``keep``; the embedding, the head, norms and weights outside the stacks as they were. An
    abstract model's (its arrays ``jax.ShapeDtypeStruct``, as the planner holds one) gets the
    shapes of its codes."""
    specs = family_of(model).param_specs(model.config)
    sizes = tuple(sorted(model.config.sizes.items()))

    def leaf(path: str, w):
        if not quantized_here(path, specs[path], keep):
            return w
        return quantize_stack(path, specs[path], sizes, w, quantize, shapes, weight)

    return map_params(leaf, model)


def quantized_here(path: str, p: Param, keep: tuple[str, ...] = ()) -> bool:
    """Whether a quantized base holds this parameter quantized: a layer stack's linear weight
    (one a LoRA target may name, :func:`zoo.lora.linear_weights`) whose module is not named in
    ``keep``."""
    return path in linear_weights({path: p}) and is_layer_stack(p) and module_of(p).rsplit(".", 1)[-1] not in keep


def quantize_stack(path: str, p: Param, sizes: tuple[tuple[str, int], ...], w: object, quantize: Quantize,
                   shapes: Shapes, weight: Callable[..., QuantizedWeight]) -> QuantizedWeight:  # fmt: skip
    """One layer stack's weight ``w`` (in the family's layout: an array, a host buffer, or its
    ``ShapeDtypeStruct`` for the shapes only) quantized a stored matrix at a time."""
    stacked = w.shape[: len(p.stacked)]
    out_in = p.hf_shape(dict(sizes))
    static = {"param": p, "sizes": sizes, "dtype": str(w.dtype)}
    if isinstance(w, jax.ShapeDtypeStruct):
        fields = shapes(out_in, path)
        zeros = lambda: {k: jnp.zeros((*stacked, *s), d) for k, (s, d) in fields.items()}  # noqa: E731
        return jax.eval_shape(lambda: weight(**zeros(), **static))
    # A global array of several processes: each process gathers a stacked entry (a layer) whole
    # and quantizes all of it; the codes stay on the host, for the mesh's layout to place.
    several = isinstance(w, jax.Array) and not w.is_fully_addressable
    per, held = [], None
    for idx in np.ndindex(*stacked):
        if several and (held is None or idx[1:] == (0,) * (len(idx) - 1)):
            held = host_value(w[idx[0]])
        matrix = held[idx[1:]] if several else w[idx]
        per.append(quantize(np.asarray(matrix, np.float32).transpose(_to_hf(p)).reshape(out_in), f"{path}[{idx}]"))
    arrays = {k: np.stack([q[k] for q in per]).reshape(*stacked, *np.shape(per[0][k])) for k in per[0]}
    return weight(**{k: v if several else jnp.asarray(v) for k, v in arrays.items()}, **static)


def load_quantized(path: str | Path, quantize: Quantize, shapes: Shapes, weight: Callable[..., QuantizedWeight],
                   **options: Any) -> CausalLM:  # fmt: skip
    """A Hugging Face checkpoint loaded as :func:`zoo.from_pretrained` loads it (``options``: its
    keywords, one device), each layer stack's linear weight quantized on the host as it is
    read: the device never holds one unquantized (70B's bfloat16 weights need not fit it)."""

    def convert(name: str, p: Param, sizes: Mapping[str, int], host: np.ndarray) -> QuantizedWeight | None:
        if not quantized_here(name, p):
            return None
        return quantize_stack(name, p, tuple(sorted(sizes.items())), host, quantize, shapes, weight)

    return from_pretrained(path, convert=convert, **options)


def _laid_out(w: Float[Array, "*dims"], p: Param, sizes: Mapping[str, int]) -> Float[Array, "*block"]:
    """A layer's whole weight ``w`` (``p``'s letters last; the stacked ones as laid out), or
    inside the parallel step the block of it this device holds by the model's layout."""
    step = current_step()
    if step is None:
        return w
    axes = param_axes(p, step.mesh, rules=step.rules, sizes=sizes)
    for i, letter in enumerate(p.names):
        j = w.ndim - len(p.names) + i
        if letter not in p.stacked and j >= 0:
            w = block_of(w, j, axis_names(axes[i]))
    return w


def _to_hf(p: Param) -> list[int]:
    """The transposition of one stored matrix from the family's layout (stacked axes gone) to
    its checkpoint's letters' order (then reshaped: ``[out, in]``)."""
    inner = [a for a in p.names if a not in p.stacked]
    return [inner.index(a) for g in p.hf_groups() for a in g]


def _quantized(x: object) -> bool:
    return isinstance(x, QuantizedWeight)


def formats(model: object) -> set[str]:
    """The quantized formats ``model`` (or an adapted model's base) holds weights in."""
    return {x.format for x in jax.tree.leaves(model, is_leaf=_quantized) if _quantized(x)}


def dequantized(model: CausalLM) -> CausalLM:
    """``model`` with its quantized weights dequantized (a plain model of the family)."""
    return jax.tree.map(lambda x: x.stacked_value() if _quantized(x) else x, model, is_leaf=_quantized)


def nbytes(tree: object) -> int:
    """Bytes of a tree's arrays (a quantized model's: its codes and scales)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))

