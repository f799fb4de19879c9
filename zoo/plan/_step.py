"""The training step the planner reasons about: built from abstract shapes, traced per device.

Everything here works on ``jax.ShapeDtypeStruct`` trees and a ``jax.sharding.AbstractMesh``:
no array is allocated and no device is needed, whatever the model's size or the mesh's. The
step is ``zoo.train.make_train_step``'s own (AdamW, one micro-batch), so the traced program is
the one training runs; ``compile`` lowers the same step onto the devices present.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec, make_single_device_sharding

from zoo import lora, parallel, train
from zoo.core.layout import is_laid_out, model_specs
from zoo.core.params import is_param, map_params, path_name
from zoo.core.registry import family_of, is_model
from zoo.errors import ConfigError, MeshError
from zoo.layers import precision as zoo_precision
from zoo.placement import PlacementMap, memory_space, resolve, subjaxprs

SDS = jax.ShapeDtypeStruct


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """Axis sizes of ``mesh``: ``None`` (one device), a spec ``"data=9,fsdp=8"``, a mapping, or
    a ``Mesh`` / ``AbstractMesh`` with zoo's axes."""
    if mesh is None:
        return dict.fromkeys(parallel.AXES, 1)
    if isinstance(mesh, str):
        return parallel.parse_mesh(mesh)
    if isinstance(mesh, Mapping):
        sizes = dict.fromkeys(parallel.AXES, 1)
        for name, size in mesh.items():
            parallel.check_axis(name, "mesh")
            sizes[name] = int(size)
        return sizes
    shape = dict(mesh.shape)
    missing = [a for a in parallel.AXES if a not in shape]
    if missing:
        raise MeshError(
            f"mesh has no axis {missing[0]!r}; build it with zoo.parallel.make_mesh (axes: {', '.join(parallel.AXES)})"
        )
    return {a: int(shape[a]) for a in parallel.AXES}


def abstract_mesh(sizes: Mapping[str, int]) -> AbstractMesh:
    return AbstractMesh(
        tuple(sizes[a] for a in parallel.AXES), parallel.AXES, axis_types=(AxisType.Auto,) * len(parallel.AXES)
    )


def mesh_spec(sizes: Mapping[str, int]) -> str:
    """``"data=9,fsdp=8"`` (axes of size 1 left out; ``""`` for one device)."""
    return ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1)


def _is_sds(x: Any) -> bool:
    return isinstance(x, SDS)


def abstract_model(model_or_config: Any, compute_dtype: Any = None) -> eqx.Module:
    """The model as shapes only: a config is built under ``jax.eval_shape`` (its weights never
    exist); a model has its arrays replaced by their shapes."""
    if is_model(model_or_config) or isinstance(model_or_config, lora.LoraModel):
        model = model_or_config
        if compute_dtype is not None and jnp.dtype(compute_dtype) != model.compute_dtype:
            raise ConfigError(
                f"compute_dtype={jnp.dtype(compute_dtype).name} for a model that computes in "
                f"{model.compute_dtype.name}; give its config to plan another compute dtype"
            )
        return jax.tree.map(
            lambda x: SDS(x.shape, x.dtype) if isinstance(x, (jax.Array, np.ndarray, SDS)) else x, model
        )
    cls = family_of(model_or_config)  # a TypeError naming the families for anything else
    dtype = jnp.float32 if compute_dtype is None else compute_dtype
    return jax.eval_shape(lambda: cls(model_or_config, key=jax.random.key(0), compute_dtype=dtype))


@dataclass
class Step:
    """One training step of ``model`` (abstract) at a global batch, on a mesh of ``sizes``."""

    model: Any
    sizes: dict[str, int]
    batch_size: int
    seq_len: int
    placement: PlacementMap | None
    param_memory: str
    opt_memory: str
    # With a pipeline axis: the micro-batches each device's rows flow through the stages in
    # (zoo.pipeline; None: zoo's default, one per stage), and the chunks of each stage's layers
    # (the interleaved schedule; 1: GPipe). Ignored without one.
    microbatches: int | None = None
    virtual_stages: int = 1
    schedule: str = "gpipe"  # or "1f1b" (zoo.parallel.one_f_one_b)
    # The family's precision map (zoo.layers.precision): which matmuls the cost model prices as
    # FP8 products; the traced step (memory) is the one with it, its FP8 residuals one byte an element.
    precision: Any = None

    def __post_init__(self) -> None:
        memory_space(self.param_memory, "parameters")
        memory_space(self.opt_memory, "optimizer state")
        self.config = self.model.config
        self.mesh = abstract_mesh(self.sizes)
        lora.check_trainable(self.model, mesh=self.mesh)  # as training refuses it (LoRA on a mesh, say)
        parallel.validate_mesh(self.mesh, self.config)
        # As laid out on the mesh: dimensions it does not divide padded (zoo.parallel.layout_sizes).
        self.model = parallel.pad(self.model, self.mesh)
        self.axes = tuple(a for a in parallel.BATCH_AXES if self.sizes[a] > 1)
        shards = math.prod(self.sizes[a] for a in self.axes)
        if self.batch_size < 1 or self.batch_size % shards:
            raise MeshError(
                f"batch size {self.batch_size} is not divisible by the batch axes "
                f"{' x '.join(f'{a}={self.sizes[a]}' for a in parallel.BATCH_AXES)} = {shards}"
            )
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be >= 2 (a next-token loss), got {self.seq_len}")
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit is not None and self.seq_len > limit:
            raise ConfigError(f"seq_len {self.seq_len} is beyond the model's max_position_embeddings {limit}")
        self.local_batch = self.batch_size // shards
        self.stages = self.sizes[parallel.PIPELINE]
        if self.stages > 1:
            m = self.stages if self.microbatches is None else self.microbatches
            if not isinstance(m, int) or m < 1 or self.local_batch % m:
                raise MeshError(
                    f"microbatches={m} must be a positive integer dividing each device's {self.local_batch} rows "
                    f"(batch {self.batch_size} over the batch axes; pipeline={self.stages})"
                )
            v = self.virtual_stages
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (v > 1 and m % self.stages):
                raise MeshError(
                    f"virtual_stages={v!r}: the interleaved schedule takes a positive integer, and more than 1 only "
                    f"with microbatches ({m}) a multiple of the {self.stages} pipeline stages"
                )
            if v > 1:  # each stage's layers must split into v chunks too, as the training step checks
                parallel.validate_mesh(self.mesh, self.config, virtual_stages=v)
        else:
            self.microbatches, self.virtual_stages, self.schedule = None, 1, "gpipe"
        self.skeleton = jax.tree.map(lambda s: np.zeros((), s.dtype) if _is_sds(s) else s, self.model, is_leaf=_is_sds)
        self.tc = train.TrainConfig(steps=2, batch_size=self.batch_size, seq_len=self.seq_len, warmup=0,
                                    microbatches=self.microbatches, virtual_stages=self.virtual_stages,
                                    schedule=self.schedule, precision=self.precision)  # fmt: skip
        self.tx = train.optimizer(self.tc, self.skeleton)
        self.params = eqx.filter(self.model, _is_sds, is_leaf=_is_sds)
        self.opt = jax.eval_shape(self.tx.init, eqx.filter(self.params, is_param))  # (not a quantized base's codes)

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    # -- layout ---------------------------------------------------------------------------
    def specs(self, tree: Any) -> Any:
        """A ``PartitionSpec`` per array leaf of ``tree`` (a model, or a tree holding models:
        the optimizer's moments), from the parameter description; other leaves replicated."""
        rules = type(self.config).axis_rules

        def of_model(m: Any) -> Any:
            described = model_specs(m)  # (a LoRA model's: its adapters by their weights' stacked letters)

            def leaf(path, x):
                if not _is_sds(x):
                    return x
                name = path_name(path)
                if name not in described:  # a quantized weight's codes in a model without adapters: whole
                    return PartitionSpec()
                return PartitionSpec(*parallel.param_axes(described[name], self.mesh, rules=rules,
                                                           sizes=self.config.sizes))

            return jax.tree_util.tree_map_with_path(leaf, m, is_leaf=_is_sds)

        def sub(x: Any) -> Any:
            if is_laid_out(x):
                return of_model(x)
            return PartitionSpec() if _is_sds(x) else x

        return jax.tree.map(sub, tree, is_leaf=lambda x: is_laid_out(x) or _is_sds(x))

    def divisor(self, spec: PartitionSpec) -> int:
        n = 1
        for entry in spec:
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                n *= self.sizes[axis]
        return n

    def per_device(self, tree: Any) -> int:
        """Bytes one device holds of ``tree``'s arrays under their layout."""
        leaves = jax.tree.leaves(tree, is_leaf=_is_sds)
        specs = jax.tree.leaves(self.specs(tree), is_leaf=lambda x: isinstance(x, PartitionSpec))
        return sum(_nbytes(x) // self.divisor(s) for x, s in zip(leaves, specs))

    def gradient_bytes(self) -> int:
        """Bytes one device holds of the step's gradients: one per trainable parameter (a frozen
        base, LoRA's or QLoRA's, gets none)."""

        def trained(m: Any) -> Any:
            specs = model_specs(m)
            return map_params(lambda path, x: x if path in specs and specs[path].trainable else None, m)

        return self.per_device(jax.tree.map(lambda x: trained(x) if is_laid_out(x) else x, self.params, is_leaf=is_laid_out))

    def arguments(self) -> tuple[Any, ...]:
        return (self.params, self.opt, SDS((1, self.batch_size, self.seq_len), jnp.int32), SDS((), jnp.int32))

    def arg_divisors(self) -> list[int]:
        out = []
        for tree in (self.params, self.opt):
            specs = jax.tree.leaves(self.specs(tree), is_leaf=lambda x: isinstance(x, PartitionSpec))
            out += [self.divisor(s) for s in specs]
        shards = self.batch_size // self.local_batch
        return out + [shards, 1]

    def shape_divisors(self) -> dict[tuple[int, ...], int]:
        leaves = jax.tree.leaves(self.params, is_leaf=_is_sds)
        specs = jax.tree.leaves(self.specs(self.params), is_leaf=lambda x: isinstance(x, PartitionSpec))
        out: dict[tuple[int, ...], int] = {}
        for x, s in zip(leaves, specs):
            out.setdefault(tuple(x.shape), self.divisor(s))
        return out

    # -- the step -------------------------------------------------------------------------
    def function(self, mesh: Any = None) -> Any:
        mesh = self.mesh if mesh is None else mesh
        return train.make_train_step(
            self.skeleton, self.tc, self.tx, placement=self.placement, mesh=mesh if self.devices > 1 else None,
            param_memory=self.param_memory, opt_memory=self.opt_memory,
        )  # fmt: skip

    def trace(self) -> Any:
        """The step's jaxpr on the abstract mesh (per-device shapes inside ``shard_map``)."""
        return jax.make_jaxpr(self.function())(*self.arguments())

    def compile(self, compiler_options: Mapping[str, Any] | None = None,
                devices: Sequence[Any] | None = None) -> tuple[Any, Any]:  # fmt: skip
        """The step traced once on ``devices`` (default: the devices present; a mesh of
        ``sizes`` over them) and compiled: ``(jaxpr, compiled)``. A TPU topology's devices
        (``jax.experimental.topologies``) compile it ahead of time for chips not present."""
        fn, args = self._concrete(list(jax.devices()) if devices is None else list(devices))
        traced = fn.trace(*args)
        return traced.jaxpr, traced.lower().compile(dict(compiler_options or {}))

    def _concrete(self, devices: list[Any]) -> tuple[Any, tuple[Any, ...]]:
        n = self.devices
        if n > len(devices):
            raise MeshError(f"mesh {mesh_spec(self.sizes)} has {n} devices; {len(devices)} are present to compile for")
        if n > 1:
            mesh = parallel.make_mesh(self.sizes, devices=devices[:n])

            def put(tree, kind):
                specs = self.specs(tree)
                return jax.tree.map(
                    lambda x, s: SDS(x.shape, x.dtype, sharding=NamedSharding(mesh, s, memory_kind=kind)),
                    tree, specs, is_leaf=_is_sds,
                )  # fmt: skip

            batch = NamedSharding(mesh, PartitionSpec(None, self.axes if self.axes else None))
            index = NamedSharding(mesh, PartitionSpec())
        else:
            mesh, device = None, devices[0]

            def put(tree, kind):
                sharding = make_single_device_sharding(device, memory_kind=kind)
                return jax.tree.map(lambda x: SDS(x.shape, x.dtype, sharding=sharding), tree, is_leaf=_is_sds)

            batch = index = make_single_device_sharding(device)
        params, opt, ids, idx = self.arguments()
        args = (
            put(params, self.param_memory),
            put(opt, self.opt_memory),
            SDS(ids.shape, ids.dtype, sharding=batch),
            SDS(idx.shape, idx.dtype, sharding=index),
        )
        return self.function(mesh), args


def _nbytes(x: Any) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


class StepOptions(TypedDict, total=False):
    """How a planned step is laid out besides its batch and sequence; every key is optional.
    :func:`make_step`, ``estimate``, ``measure`` and the planner take them as keywords."""

    placement: Any  # a placement map or its spec; None (the default): no jax.checkpoint
    mesh: Any  # None (one device), a spec "data=9,fsdp=8", a mapping or a mesh
    param_memory: str  # where parameters live between steps: "device" (default) or "pinned_host"
    opt_memory: str  # the same for the optimizer state
    compute_dtype: Any  # a config is built abstractly in this dtype (default float32)
    microbatches: int  # with a pipeline axis: micro-batches per device's rows (default: one per stage)
    virtual_stages: int  # with a pipeline axis: chunks per stage, the interleaved schedule (default 1: GPipe)
    schedule: str  # with a pipeline axis: "gpipe" (default) or "1f1b"
    precision: Any  # a precision map or its spec (zoo.layers.precision): FP8 matmuls priced at the FP8 peak


def make_step(model_or_config: Any, *, batch_size: int, seq_len: int, **options: Unpack[StepOptions]) -> Step:
    """The step of ``model_or_config`` (a model, whose arrays' shapes are used, or a config) on
    a global batch of ``batch_size`` rows of ``seq_len`` tokens, laid out as ``options`` say."""
    if unknown := set(options) - set(StepOptions.__annotations__):
        raise TypeError(
            f"unknown step option(s) {sorted(unknown)}: the options are {list(StepOptions.__annotations__)}"
        )
    model = abstract_model(model_or_config, options.get("compute_dtype"))
    placement = options.get("placement")
    if placement is not None:
        placement = resolve(placement, model)
    precision = options.get("precision")
    if precision is not None:
        precision = zoo_precision.resolve(precision, model)
    return Step(model, mesh_sizes(options.get("mesh")), int(batch_size), int(seq_len), placement,
                options.get("param_memory", "device"), options.get("opt_memory", "device"),
                options.get("microbatches"), options.get("virtual_stages", 1), options.get("schedule", "gpipe"),
                precision)  # fmt: skip


# -- reading the traced program -------------------------------------------------------------------


@dataclass(frozen=True)
class Stack:
    """The named tensors of one layer stack (a scanned body run ``length`` times, or a block
    outside any scan: ``length`` 1): name -> per-device bytes per body of the arrays that carry
    the name there (:func:`_saved_bytes`: an FP8 residual's copy and its scales, not the tensor
    it replaces).

    A pipelined stack (:mod:`zoo.pipeline`) is a scan over ``ticks`` ticks of the GPipe
    schedule, each running this stage's ``length`` layers on one micro-batch (the shapes are a
    micro-batch's): every tick's tensors are saved, the bubble's too."""

    length: int
    names: dict[str, int]
    ticks: int = 1

    @property
    def pipelined(self) -> bool:
        return self.ticks > 1


def is_tick_scan(body: Any) -> bool:
    """Whether a scan's ``body`` is the pipeline's tick loop (:func:`zoo.pipeline.pipelined_scan`):
    it hands activations to the next stage with a ``ppermute`` over ``"pipeline"``, outside any
    scan nested in it."""
    return tick_ring(body) > 0


def tick_ring(body: Any) -> int:
    """The (source, target) pairs of the ``ppermute`` over ``"pipeline"`` in a scan's ``body``,
    outside any scan nested in it: 0 where there is none (not a tick loop), ``P - 1`` in GPipe's
    tick loop, ``P`` in the interleaved schedule's (the last stage hands on to the first)."""
    todo = [body.jaxpr if hasattr(body, "jaxpr") and hasattr(body.jaxpr, "eqns") else body]
    while todo:
        for eqn in todo.pop().eqns:
            if eqn.primitive.name == "ppermute":
                names = eqn.params.get("axis_name", ())
                if parallel.PIPELINE in (names if isinstance(names, tuple) else (names,)):
                    return len(eqn.params["perm"])
            elif eqn.primitive.name != "scan":
                todo.extend(subjaxprs(eqn))
    return 0


def layer_stacks(jaxpr: Any) -> list[Stack]:
    """The forward pass's layer stacks in a traced training step, each once.

    After autodiff the forward scans come first, then the backward ones, whose remat bodies
    recompute a subset of the same names: a scan whose names are a subset of an earlier scan
    of the same length is a backward copy, and named tensors outside any scan are counted
    only before the first backward scan. A pipeline's tick loop is one stack: its length is the
    stage's layer scan nested in it, its ``ticks`` the loop's. Names inside a ``while`` loop (a
    trip count that follows the data: the MoE dispatch's later rounds) are not counted: autodiff
    saves nothing of a while loop's iterations (a custom VJP around it recomputes them). Names
    in a scan inside a layer's body (the MoE layer's loop over blocks of experts) count once
    per iteration: each iteration's are saved."""
    scans: list[list] = []  # [(ticks, length), {name: [(dtype, bytes), ...]}, position, length known]
    outside: list[tuple[int, str, Any, int]] = []  # (position, name, dtype, bytes)
    counter = [0]

    def walk(j: Any, scan: list | None, times: int = 1) -> None:
        for eqn in j.eqns:
            counter[0] += 1
            if eqn.primitive.name == "name":
                aval = eqn.outvars[0].aval
                if scan is None:
                    outside.append((counter[0], eqn.params["name"], aval.dtype, _nbytes(aval)))
                else:
                    scan[1].setdefault(eqn.params["name"], []).append((aval.dtype, times * _nbytes(aval)))
            inner, inner_times = scan, times
            if eqn.primitive.name == "while":
                continue
            if eqn.primitive.name == "scan":
                n = eqn.params["length"]
                if scan is None and is_tick_scan(eqn.params["jaxpr"]):
                    inner = [(n, 1), {}, counter[0], False]
                    scans.append(inner)
                elif scan is None and n > 1:
                    inner = [(1, n), {}, counter[0], True]
                    scans.append(inner)
                elif scan is not None and not scan[3]:
                    scan[0], scan[3] = (scan[0][0], n), True  # the stage's layers inside a tick (maybe one)
                elif scan is not None:
                    inner_times = times * n  # a loop inside the layer: each iteration's names
            for sub in subjaxprs(eqn):
                walk(sub, inner, inner_times)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr, None)
    stacks: list[Stack] = []
    named = [sc for sc in scans if sc[1]]
    k = len(named) // 2
    mirrored = len(named) % 2 == 0 and k and [sc[0] for sc in named[k:]] == [sc[0] for sc in named[:k]][::-1]
    if mirrored:  # forward stacks, then their backward copies in reverse order
        forward, first_backward = named[:k], named[k][2]
    else:  # some backward bodies recompute nothing named: a copy shares its stack's names
        forward, first_backward = [], math.inf
        for sc in named:
            if any(sc[0] == f[0] and len(set(sc[1]) & set(f[1])) * 2 >= len(sc[1]) for f in forward):
                first_backward = min(first_backward, sc[2])
                continue
            forward.append(sc)
    for (ticks, length), names, *_ in forward:
        stacks.append(Stack(length, {n: _saved_bytes(e) for n, e in names.items()}, ticks))
    block: dict[str, list] = {}
    for position, name, dtype, nbytes in outside:
        if position < first_backward:
            block.setdefault(name, []).append((dtype, nbytes))
    if block:
        stacks.append(Stack(1, {n: _saved_bytes(e) for n, e in block.items()}))
    return stacks


def _saved_bytes(entries: list[tuple[Any, int]]) -> int:
    """The bytes a name's arrays in one body keep, given in trace order as ``(dtype, bytes)``:
    all of them, except that an FP8 residual (its copy as ``uint8`` bits, then its scales:
    :func:`zoo.layers.fp8.matmul`'s ``saved``) is what the backward pass reads in place of the
    tensor named before it, which is then not kept."""
    first = next((i for i, (dtype, _) in enumerate(entries) if dtype == jnp.uint8), 0)
    return sum(n for _, n in entries[first:])


def stack_bytes(stacks: list[Stack]) -> dict[str, int]:
    """Per-device bytes of each named tensor over every layer that has it."""
    out: dict[str, int] = {}
    for st in stacks:
        for name, nbytes in st.names.items():
            out[name] = out.get(name, 0) + st.ticks * st.length * nbytes
    return out


__all__ = ["SDS", "Stack", "Step", "StepOptions", "abstract_mesh", "abstract_model", "is_tick_scan", "layer_stacks",
           "make_step", "mesh_sizes", "mesh_spec", "stack_bytes", "tick_ring"]  # fmt: skip
