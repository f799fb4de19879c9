"""The mesh's vocabulary: its six named axes, and reading a mesh's sizes.

Every mesh zoo builds has the axes of :data:`AXES` (size 1 when unused); layouts
(:mod:`zoo.core.layout`), the in-step hooks (:mod:`zoo.hooks`) and the step itself
(:mod:`zoo.parallel`) all speak of them by these names. Nothing here builds a mesh or touches
a device: what reads only a mesh's axis names and sizes takes an abstract mesh too (the
planner traces on one).
"""

from __future__ import annotations

import difflib
import math

from jax.sharding import AbstractMesh, Mesh

from zoo.errors import MeshError

AnyMesh = Mesh | AbstractMesh

# "pipeline" splits the layer stacks into stages (zoo.hooks.pipeline); first, so it varies
# slowest over the devices: its point-to-point traffic is the least of any axis and the one to
# put across slow links. "context" splits the sequence (the batch arrays' second axis), in
# Llama 3's balanced order (zoo.hooks.context_order); attention gathers keys and values over it.
PIPELINE = "pipeline"
CONTEXT = "context"
AXES: tuple[str, ...] = (PIPELINE, "data", "fsdp", CONTEXT, "tensor", "expert")
# The expert group splits the batch too: its devices would otherwise repeat the same attention
# and dense work on the same tokens; the MoE layers then move tokens by all-to-all.
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")
# The axes a weight's FSDP dimension is stored split over (outermost first): fsdp, joined by the
# expert group, whose devices hold different tokens too and would otherwise each keep a whole
# copy of every weight outside the routed experts (MaxText's and Megatron's distributed
# optimizer split these over the expert ranks as well). The step gathers such a weight over both
# before use. A routed expert's own weights take "expert" on their expert dimension and keep
# "fsdp" alone on this one. The families' rules join "expert" as optional
# (zoo.core.protocol.AxisRule): a dimension it does not divide stays split over fsdp only.
WEIGHT_SHARDS: tuple[str, ...] = ("fsdp", "expert")


def check_axis(name: str, where: str) -> None:
    """A :class:`MeshError` naming ``where``, unless ``name`` is one of :data:`AXES`."""
    if name not in AXES:
        close = difflib.get_close_matches(name, AXES, n=1, cutoff=0.4)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise MeshError(f"{where}: unknown mesh axis {name!r}{hint}; axes: {', '.join(AXES)}")


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,fsdp=2,tensor=2"`` -> ``{"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}``.

    Every axis is present (1 when not named), so callers never special-case a missing one.
    """
    sizes = dict.fromkeys(AXES, 1)
    seen: set[str] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, eq, value = (s.strip() for s in part.partition("="))
        if not eq:
            raise MeshError(f"mesh spec {spec!r}: {part!r} is not axis=size (axes: {', '.join(AXES)})")
        check_axis(name, f"mesh spec {spec!r}")
        if name in seen:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            raise MeshError(f"mesh spec {spec!r}: size of axis {name!r} must be an integer, got {value!r}") from None
        if size < 1:
            raise MeshError(f"mesh spec {spec!r}: size of axis {name!r} must be >= 1, got {size}")
        seen.add(name)
        sizes[name] = size
    return sizes


def axis_names(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry: ``"fsdp"``, ``("pipeline", "fsdp")`` or ``None``."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def axis_size(mesh: AnyMesh, axis: str | tuple[str, ...]) -> int:
    """Devices along ``axis`` of ``mesh``, or along several axes together (1 for an axis the mesh lacks)."""
    return math.prod(int(mesh.shape.get(a, 1)) for a in axis_names(axis))


# -- the interleaved pipeline's chunks --------------------------------------------------------


def chunk_size(per_stage: int, virtual: int) -> int:
    """Layers in each of a stage's ``virtual`` chunks: ``ceil(per_stage / V)``; the last chunk
    holds what is left, which may be fewer (Megatron's uneven layouts: 15 layers a stage in 4
    chunks of 4, 4, 4 and 3)."""
    return -(-per_stage // virtual)


def virtual_fits(per_stage: int, virtual: int) -> bool:
    """Whether a stage of ``per_stage`` layers runs as ``virtual`` chunks of :func:`chunk_size`,
    none of them empty."""
    return 1 <= virtual <= per_stage and (virtual - 1) * chunk_size(per_stage, virtual) < per_stage


def virtual_options(per_stage: int) -> list[int]:
    """Every ``virtual`` a stage of ``per_stage`` layers can run (:func:`virtual_fits`)."""
    return [v for v in range(1, per_stage + 1) if virtual_fits(per_stage, v)]
