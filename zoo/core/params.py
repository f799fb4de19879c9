"""One abstract description of every parameter, from which init, checkpoint I/O and sharding derive.

A model describes its parameters as a flat ``{path: Param}`` dict, where ``path`` is the
attribute path in the model pytree (``"layers.attn.wq"``). Each :class:`Param` names its axes
with the dimension letters of the model file's legend, says how to initialise it, and where it
lives in a Hugging Face checkpoint (key template and the tensor's layout in the same letters).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.extend.random import threefry2x32_p
from jaxtyping import Array, Float32, Key, PRNGKeyArray, UInt32

Init = Literal["normal", "ones", "zeros"]
_FIELD = re.compile(r"\{(\w+)(?:\+(\d+))?\}")


@dataclass(frozen=True)
class Param:
    """How one parameter array looks, starts, and is stored in a Hugging Face checkpoint.

    axes: our layout as dimension letters, stacked axes first (``"L D H K"``).
    hf: checkpoint key; ``{L}`` / ``{E}`` stand for the index along a stacked axis
        (``"model.layers.{L}.self_attn.q_proj.weight"``), ``{L+3}`` for that index plus 3
        (a stack that starts at stored layer 3). ``None``: not in checkpoints.
    hf_layout: the stored tensor's layout in the same letters; parentheses group letters
        that share one stored axis (``"(H K) D"``). Stacked axes are not part of it.
    init: ``normal`` (std from the config), ``ones`` or ``zeros``.
    trainable: ``False`` for buffers (the router's correction bias), which get no gradient.
    hf_index: for a stacked axis whose entries are not stored in a run (Qwen3's dense layers
        interleaved with MoE ones), ``((letter, stored indices), ...)``: entry ``i`` of the
        stack is stored under index ``stored[i]`` in the key.
    own_sizes: ``((letter, size), ...)`` of letters the config does not size (a quantized
        weight's codes, :data:`zoo.core.layout.CODES`), where the layout needs their size.
    matmul: the name of the :func:`zoo.layers.fp8.matmul` call that reads the weight (its
        precision map's name; ``None`` for a weight read otherwise, such as a routed expert's):
        where a wrapper adds a term of its own to that product (LoRA's dropout path).
    """

    axes: str
    hf: str | None
    hf_layout: str = ""
    init: Init = "normal"
    trainable: bool = True
    hf_index: tuple[tuple[str, tuple[int, ...]], ...] = ()
    own_sizes: tuple[tuple[str, int], ...] = ()
    matmul: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.axes.split())

    @property
    def stacked(self) -> tuple[str, ...]:
        """Axes indexed by the checkpoint key (one stored tensor per index)."""
        return tuple(name for name, _ in _FIELD.findall(self.hf or ""))

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        try:
            return tuple(int(sizes[a]) for a in self.names)
        except KeyError as e:
            raise KeyError(f"dimension letter {e} of axes {self.axes!r} has no size") from None

    def hf_groups(self) -> list[list[str]]:
        groups, tokens = [], re.findall(r"\(|\)|\w+", self.hf_layout)
        current: list[str] | None = None
        for tok in tokens:
            if tok == "(":
                current = []
            elif tok == ")":
                groups.append(current)
                current = None
            elif current is not None:
                current.append(tok)
            else:
                groups.append([tok])
        return groups

    def hf_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(math.prod(sizes[a] for a in g) for g in self.hf_groups())

    def _inner(self) -> tuple[str, ...]:
        return tuple(a for a in self.names if a not in self.stacked)

    def from_hf(self, t: np.ndarray, sizes: Mapping[str, int]) -> np.ndarray:
        """One stored tensor (HF layout) -> our layout without the stacked axes."""
        flat = [a for g in self.hf_groups() for a in g]
        t = t.reshape([sizes[a] for a in flat])
        return t.transpose([flat.index(a) for a in self._inner()])

    def hf_layout_is_ours(self) -> bool:
        """Whether the stored tensor is our layout (without the stacked axes) as it is: the same
        letters in the same order, merged or not, so a block of rows is a block of stored rows."""
        return [a for g in self.hf_groups() for a in g] == list(self._inner())

    def to_hf(self, t: np.ndarray, sizes: Mapping[str, int]) -> np.ndarray:
        """Our layout without the stacked axes -> one stored tensor (HF layout)."""
        flat = [a for g in self.hf_groups() for a in g]
        inner = self._inner()
        t = t.transpose([inner.index(a) for a in flat])
        return np.ascontiguousarray(t.reshape(self.hf_shape(sizes)))

    def hf_keys(self, sizes: Mapping[str, int]) -> Iterator[tuple[tuple[int, ...], str]]:
        """(index along the stacked axes, checkpoint key) for every stored tensor."""
        assert self.hf is not None
        stacked, stored = self.stacked, dict(self.hf_index)
        for idx in itertools.product(*(range(sizes[a]) for a in stacked)):
            at = {a: (stored[a][i] if a in stored else i) for a, i in zip(stacked, idx)}
            yield idx, _FIELD.sub(lambda m: str(at[m.group(1)] + int(m.group(2) or 0)), self.hf)


# Elements of a parameter drawn per step of its maker's loop (4 MB in float32): a draw's
# temporaries (threefry's counters and bits, the normal transform) are a few of these, not a
# few copies of the parameter or of a device's shard.
DRAW_BLOCK = 2**20


def _normal_at(data: UInt32[Array, "2"], index: UInt32[Array, "*S"]) -> Float32[Array, "*S"]:
    """``jax.random.normal(key, shape)[...]`` at the flat row-major ``index`` (uint32) of each
    element, for the key with raw ``data``: JAX's partitionable threefry (each element's bits
    are the hash of its own index), then JAX's uniform-to-normal transform, so any block of a
    draw can be made alone with the values of the whole."""
    b1, b2 = threefry2x32_p.bind(data[0], data[1], jnp.zeros_like(index), index)
    mantissa = jax.lax.shift_right_logical(b1 ^ b2, jnp.uint32(32 - 23)) | jnp.uint32(0x3F800000)
    floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - jnp.float32(1)
    lo = np.nextafter(np.float32(-1), np.float32(0))
    u = jnp.maximum(lo, floats * (np.float32(1) - lo) + lo)
    return np.float32(np.sqrt(2)) * jax.lax.erf_inv(u)


def _slabs(shape: tuple[int, ...], first: int) -> tuple[int, int]:
    """How a loop covers an array of ``shape`` in slabs of at most :data:`DRAW_BLOCK` elements:
    ``(axis, rows)``, each slab one index of every axis before ``axis`` (at least ``first`` of
    them), ``rows`` of ``axis`` (a divisor of its size) and all of the axes after it."""
    axis = first
    while axis < len(shape) - 1 and math.prod(shape[axis + 1 :]) > DRAW_BLOCK:
        axis += 1
    if axis >= len(shape):
        return axis, 1
    inner = math.prod(shape[axis + 1 :])
    rows = max((r for r in range(1, shape[axis] + 1) if shape[axis] % r == 0 and r * inner <= DRAW_BLOCK), default=1)
    return axis, rows


def _draw(data: Array, shape: tuple[int, ...], stacked: bool, offsets: list[Array | int], local: tuple[int, ...],
          std: float, dtype: jnp.dtype, padded: tuple[int, ...] | None = None, vary: tuple[str, ...] = ()
          ) -> Array:  # fmt: skip
    """Elements ``offsets : offsets + local`` of normal(0, std) draws of ``shape``, one per key of
    ``data`` (``[2]``; ``[L, 2]`` with ``stacked``: the first axis indexes the keys), slab by slab
    in a loop: values as the whole draw's, temporaries a few slabs'. ``padded``: the shape laid
    out, ``shape`` with zeros appended (elements outside ``shape`` are 0; with ``stacked``, a
    padding layer past the keys is all zeros). ``vary``: inside ``shard_map``, the mesh axes
    ``offsets`` come from (the block, and so the loop's carry, differs along them)."""
    first = int(stacked)
    inner = shape[first:]
    padded = shape if padded is None else padded
    if math.prod(inner) > 2**32:
        raise ValueError(f"a parameter of {math.prod(inner)} elements per layer (shape {shape}) is over the "
                         "2**32 a draw can index")  # fmt: skip
    strides = [math.prod(inner[d + 1 :]) for d in range(len(inner))]
    axis, rows = _slabs(local, first)
    slab = tuple([1] * axis + ([rows] if axis < len(local) else []) + list(local[axis + 1 :]))
    lead = local[:axis]
    steps = math.prod(lead) * (local[axis] // rows if axis < len(local) else 1)

    def one(step, out):
        coords, rest = [], step
        for n in reversed(local[:axis] + ((local[axis] // rows,) if axis < len(local) else ())):
            coords.append(rest % n)
            rest = rest // n
        coords = coords[::-1]
        if axis < len(local):
            coords[axis] = coords[axis] * rows
        start = [jnp.asarray(c, jnp.int32) for c in coords] + [jnp.int32(0)] * (len(local) - len(coords))
        index = jnp.zeros(slab, jnp.uint32)
        inside = None  # elements within ``shape`` (only where the layout pads)
        for d in range(len(local)):
            at = jnp.asarray(offsets[d] + start[d], jnp.uint32)
            if slab[d] > 1:
                at = at + jax.lax.broadcasted_iota(jnp.uint32, slab, d)
            if d >= first:
                index = index + at * jnp.uint32(strides[d - first])
            if padded[d] != shape[d]:
                within = jnp.broadcast_to(at < shape[d], slab)
                inside = within if inside is None else inside & within
        key = data[offsets[0] + start[0]] if stacked else data
        values = std * _normal_at(key, index)
        values = (values if inside is None else jnp.where(inside, values, 0)).astype(dtype)
        return jax.lax.dynamic_update_slice(out, values, start)

    out = jnp.zeros(local, dtype)
    if vary:
        out = jax.lax.pcast(out, vary, to="varying")
    if math.prod(local) == 0:
        return out
    return one(0, out) if steps == 1 else jax.lax.fori_loop(0, steps, one, out)


def _shard_offsets(sharding: jax.sharding.NamedSharding, local: tuple[int, ...]) -> list[Array | int]:
    """Inside ``shard_map``: where this device's block of an array laid out by ``sharding`` starts."""
    offsets: list[Array | int] = []
    spec = tuple(sharding.spec) + (None,) * (len(local) - len(sharding.spec))
    for size, names in zip(local, spec, strict=True):
        names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
        index: Array | int = 0
        for name in names:
            index = index * sharding.mesh.shape[name] + jax.lax.axis_index(name)
        offsets.append(index * size)
    return offsets


def _zero_pad(x: Array, shape: tuple[int, ...]) -> Array:
    return jnp.pad(x, [(0, b - a) for a, b in zip(x.shape, shape)]) if x.shape != shape else x


@functools.cache
def _maker(shape: tuple[int, ...], init: str, std: float, dtype: jnp.dtype, impl: str, length: int | None,
           sharding: jax.sharding.Sharding | None, padded: tuple[int, ...] | None = None,
           padded_length: int | None = None) -> Callable:  # fmt: skip
    """One parameter's jitted maker, from its key's raw data (``[length, 2]`` per layer for a
    stack): normal(0, std) draws (``jax.random.normal``'s values for each key) or a constant,
    laid out by ``sharding``, each device making only its own block, a slab at a time. One
    compile per distinct shape and layout, shared by every parameter that has them.
    ``padded``: the parameter's shape as laid out, zeros after ``shape``'s values;
    ``padded_length``: a stack's layers as laid out, zero layers after ``length``."""
    full = shape if length is None else (length, *shape)
    inner = shape if padded is None else padded
    out = inner if length is None else (padded_length or length, *inner)
    if init != "normal":
        fill = jnp.ones if init == "ones" else jnp.zeros
        return jax.jit(lambda data: _zero_pad(fill(full, dtype), out), out_shardings=sharding)
    if impl != "threefry2x32":  # another generator: drawn whole, as jax.random.normal draws it

        def whole(data):
            draw = lambda d: (std * jr.normal(jr.wrap_key_data(d, impl=impl), shape, jnp.float32)).astype(dtype)  # noqa: E731
            return _zero_pad(draw(data) if length is None else jax.vmap(draw)(data), out)

        return jax.jit(whole, out_shardings=sharding)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return jax.jit(lambda data: _draw(data, full, length is not None, [0] * len(full), out, std, dtype, out),
                       out_shardings=sharding)  # fmt: skip
    local = sharding.shard_shape(out)

    vary = tuple(dict.fromkeys(a for e in sharding.spec if e is not None for a in ((e,) if isinstance(e, str) else e)))

    def block(data):
        return _draw(data, full, length is not None, _shard_offsets(sharding, local), local, std, dtype, out, vary)

    spec = jax.sharding.PartitionSpec(*sharding.spec)
    mapped = jax.shard_map(block, mesh=sharding.mesh, in_specs=jax.sharding.PartitionSpec(), out_specs=spec)
    return jax.jit(mapped, out_shardings=sharding)


def _host(data: Array) -> Array | np.ndarray:
    """Key data as a host value where it is concrete: every process of a multi-host run passes
    the same one into a program whose output spans them all."""
    try:
        return np.asarray(data)
    except jax.errors.TracerArrayConversionError:  # traced (an abstract model, a model made inside jit)
        return data


def init_params(
    specs: Mapping[str, Param],
    sizes: Mapping[str, int],
    *,
    key: PRNGKeyArray | Key[Array, " L"],
    std: float,
    dtype,
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
    prefix: str = "",
    length: int | None = None,
    padded: Mapping[str, int] | None = None,
    padded_length: int | None = None,
) -> dict[str, Array]:
    """Fresh arrays for every parameter: normal(0, std), ones or zeros.

    Each normal parameter draws from its own key (split from ``key`` in path order), shaped as
    the parameter, in a program of its own: with ``shardings`` (``prefix + path`` -> sharding)
    each device computes only its shard (JAX's partitionable threefry: the same values as
    unsharded), and at most one parameter's temporaries exist at a time (one program for the
    whole model held them all at once). ``length``: ``key`` holds one key per layer of a
    stack of that many (each layer splits its own keys, as a vmap over layers would).
    ``padded``: the letters' sizes as laid out on a mesh (:func:`zoo.core.layout.layout_sizes`):
    each array has them, its values those of ``sizes`` and zeros after; ``padded_length``: the
    stack's layers as laid out (a pipelined stack the stages do not divide), zero layers after
    ``length``, as :func:`zoo.core.layout.pad` lays out a model made elsewhere.
    """
    normal = [path for path, p in sorted(specs.items()) if p.init == "normal"]
    n = max(len(normal), 1)
    split = jr.split(key, n) if length is None else jax.vmap(lambda k: jr.split(k, n))(key)
    data = jr.key_data(split)
    impl = str(jr.key_impl(key))
    index = {path: i for i, path in enumerate(normal)}
    out = {}
    for path, p in sorted(specs.items()):
        sharding = None if shardings is None else shardings[prefix + path]
        laid = None if padded is None or p.shape(padded) == p.shape(sizes) else p.shape(padded)
        more = None if padded_length == length else padded_length
        make = _maker(p.shape(sizes), p.init, float(std), jnp.dtype(dtype), impl, length, sharding, laid, more)
        i = index.get(path, 0)
        out[path] = make(_host(data[i] if length is None else data[:, i]))
    return out


def init_with_stacks(
    specs: Mapping[str, Param],
    sizes: Mapping[str, int],
    stacks: Mapping[str, str],
    *,
    key: PRNGKeyArray,
    std: float,
    dtype,
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
    padded: Mapping[str, int] | None = None,
) -> dict[str, Array]:
    """Fresh arrays for a model whose layers come in stacks (``{path prefix: stacked letter}``,
    e.g. ``{"dense_layers": "Ld", "moe_layers": "Lm"}``): each stack from per-layer keys, the
    rest by :func:`init_params` (``shardings``: by full path; ``padded``: sizes as laid out).
    A stack of size 0 is left out."""
    keys = dict(zip(["rest", *stacks], jr.split(key, len(stacks) + 1)))
    rest = {p: s for p, s in specs.items() if p.split(".")[0] not in stacks}
    arrays = init_params(rest, sizes, key=keys["rest"], std=std, dtype=dtype, shardings=shardings, padded=padded)
    for prefix, axis in stacks.items():
        if not sizes[axis]:
            continue
        layer_specs = strip_prefix(specs, prefix, axis)
        stacked = init_params(layer_specs, sizes, key=jr.split(keys[prefix], sizes[axis]), std=std, dtype=dtype,
                              shardings=shardings, prefix=prefix + ".", length=sizes[axis], padded=padded,
                              padded_length=None if padded is None else padded[axis])  # fmt: skip
        arrays.update({f"{prefix}.{p}": a for p, a in stacked.items()})
    return arrays


def strip_prefix(specs: Mapping[str, Param], prefix: str, drop_axis: str) -> dict[str, Param]:
    """The specs under ``prefix.``, seen from inside one slice of the stacked axis ``drop_axis``."""
    out = {}
    for path, p in specs.items():
        if path.startswith(prefix + "."):
            names = [a for a in p.names if a != drop_axis]
            hf = _FIELD.sub(lambda m: "0" if m.group(1) == drop_axis else m.group(0), p.hf) if p.hf else None
            out[path[len(prefix) + 1 :]] = dataclasses.replace(p, axes=" ".join(names), hf=hf)
    return out


def _field_types(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _module_type(t) -> type | None:
    """The eqx.Module class in a field annotation (``Attention`` or ``Attention | None``)."""
    options = typing.get_args(t) if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union else (t,)
    for o in options:
        if isinstance(o, type) and issubclass(o, eqx.Module):
            return o
    return None


def build(cls: type, arrays: Mapping[str, object], prefix: str = "", **static) -> eqx.Module:
    """Assemble module ``cls`` from a flat ``{path: array}`` dict, recursing into sub-module fields.

    A field whose path has no array (and no sub-arrays) is ``None``, e.g. an absent tied head.
    """
    kwargs = dict(static)
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in kwargs or f.metadata.get("static", False):
            continue
        path = f"{prefix}{f.name}"
        sub = _module_type(hints[f.name])
        if path in arrays:
            kwargs[f.name] = arrays[path]
        elif sub is not None and any(k.startswith(path + ".") for k in arrays):
            kwargs[f.name] = build(sub, arrays, path + ".")
        else:
            kwargs[f.name] = None
    return cls(**kwargs)


def flatten(module: eqx.Module) -> dict[str, Array]:
    """The inverse of :func:`build`: ``{path: array}`` for every array leaf."""
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(module, is_leaf=lambda x: x is None)[0]
    for path, leaf in leaves:
        if isinstance(leaf, (jax.Array, np.ndarray)):
            out[path_name(path)] = leaf
    return out


class Deferred(eqx.Module):
    """A stacked weight given as what computes it (a weight and its LoRA adapter): its leaves
    are stacked as the weight is, and :func:`zoo.layers.stack.scan_layers` computes the value
    of each layer's slice inside the layer's body, so only one layer's value exists at a time
    (and the backward pass's cotangent of it)."""

    def value(self) -> Array:
        """The weight of one layer (called on a layer's slice)."""
        raise NotImplementedError

    def stacked_value(self) -> Array:
        """The whole stack's weight (every layer's value)."""
        return jax.vmap(lambda one: one.value())(self)

    def field_params(self) -> dict[str, Param]:
        """The description of the arrays it holds, by field name (a frozen base's: untrained)."""
        raise NotImplementedError(f"{type(self).__name__} is not held in a model between steps")


def is_deferred(x: object) -> bool:
    return isinstance(x, Deferred)


def run_state(model: eqx.Module) -> tuple[eqx.Module, eqx.Module]:
    """``(state, static)``: what a training run carries from step to step (the floating
    arrays, and each :class:`Deferred` weight whole: a quantized base's integer codes with their
    scales) and the rest, ``eqx.partition``'s halves (``eqx.combine`` joins them)."""
    whole = lambda x: jax.tree.map(lambda _: True, x) if is_deferred(x) else eqx.is_inexact_array(x)  # noqa: E731
    return eqx.partition(model, jax.tree.map(whole, model, is_leaf=is_deferred))


def path_name(keys: tuple) -> str:
    """A pytree key path as a parameter path (``"layers.attn.wq"``): the keys of
    ``jax.tree_util.tree_map_with_path`` joined by dots."""
    return ".".join(str(getattr(k, "name", k)) for k in keys)


def with_values(tree: object) -> object:
    """``tree`` with each :class:`Deferred` replaced by its value."""
    return jax.tree.map(lambda x: x.value() if isinstance(x, Deferred) else x, tree,
                        is_leaf=lambda x: isinstance(x, Deferred))  # fmt: skip


def is_array(x: object) -> bool:
    """An array leaf of a model: an array, or its ``ShapeDtypeStruct`` (an abstract model's)."""
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def is_param(x: object) -> bool:
    """A parameter leaf: a floating array, or its ``ShapeDtypeStruct`` (an abstract model's)."""
    if is_array(x):
        # (not eqx.is_inexact_array: NumPy's own subdtype test calls a bfloat16 array not floating)
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return False


def map_params(fn: Callable[[str, Array], object], module: eqx.Module) -> eqx.Module:
    """Apply ``fn(path, array)`` to every array leaf of a model (arrays or their
    ``ShapeDtypeStruct``), keeping the structure."""

    def leaf(path, x):
        if is_array(x):
            return fn(path_name(path), x)
        return x

    return jax.tree_util.tree_map_with_path(leaf, module)
