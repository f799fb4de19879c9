"""The meshes of a device count, and the quick model that ranks them: the first steps of the mesh
search (:mod:`zoo.plan.search`), with the table of what it planned.

- :func:`meshes`: every assignment of the devices to ``zoo.parallel.AXES`` the model accepts, a
  pipeline only where each stage holds a real layer (:func:`pipeline_sizes`);
- :func:`worth_pipelining`: the pipelined meshes worth planning on the hardware's fast domains;
- :func:`mesh_state`: parameters, gradients and AdamW moments per device, exact, for the memory
  pruning; :func:`quick_rows` / :func:`quick_time`: the quick model's step;
- :class:`MeshRow` / :func:`mesh_table`: one mesh's row of the search, and the table of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from zoo import parallel
from zoo.core.mesh import PIPELINE
from zoo.core.registry import family_of
from zoo.errors import MeshError
from zoo.hardware import Hardware
from zoo.layers.moe_dispatch import Dispatch
from zoo.plan import collectives
from zoo.plan._step import abstract_mesh


@dataclass(frozen=True)
class MeshRow:
    """One mesh of the search: its per-device state, the quick model's seconds per sequence and
    per device, and (planned in full) its best batch and figures; ``why`` where it was dropped."""

    mesh: str
    state_bytes: float  # parameters + gradients + AdamW moments per device
    quick: float
    batch_size: int | None = None
    device_bytes: float = 0.0
    host_bytes: float = 0.0
    step_time: float = 0.0
    mfu: float = 0.0
    tokens_per_s_device: float = 0.0
    placement: str = ""
    why: str = ""
    virtual_stages: int = 1  # the plan's interleaved schedule (1: GPipe, or no pipeline)


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered ``k``-tuples of positive integers whose product is ``n``."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, k - 1)]


def pipelined_layers(config: Any) -> list[int]:
    """The layer counts of ``config``'s stacks that a ``pipeline`` axis splits into stages (the
    dimension letters its family maps to ``pipeline``); empty where none is."""
    rules = type(config).axis_rules.items()
    return [config.sizes[letter] for letter, rule in rules if parallel.axis_names(rule.mesh_axis) == (PIPELINE,)]


def pipeline_sizes(config: Any, devices: int) -> list[int]:
    """1, and each pipeline size ``P > 1`` dividing ``devices`` that leaves every stage a real
    layer of each of ``config``'s pipelined stacks."""
    counts = pipelined_layers(config)
    return [1] + [p for p in range(2, devices + 1)
                  if counts and not devices % p and all((p - 1) * -(-n // p) < n for n in counts)]  # fmt: skip


def meshes(config: Any, devices: int, seq_len: int) -> list[dict[str, int]]:
    """Every mesh of ``devices`` that ``config`` accepts (``validate_mesh``), with a pipeline
    size of :func:`pipeline_sizes`, and whose context axis divides the sequence into its
    ``2 x context`` equal chunks."""
    out = []
    searched = tuple(a for a in parallel.AXES if a != PIPELINE)
    for stages in pipeline_sizes(config, devices):
        for shape in factorizations(devices // stages, len(searched)):
            sizes = {PIPELINE: stages, **dict(zip(searched, shape))}
            if seq_len % (2 * sizes["context"]) and sizes["context"] > 1:
                continue
            try:
                parallel.validate_mesh(abstract_mesh(sizes), config)
            except MeshError:
                continue
            out.append(sizes)
    return out


def worth_pipelining(found: list[dict[str, int]], states: list[float], devices: int, domain: int) -> list[bool]:
    """Which of the meshes ``found`` (their state bytes per device ``states``) the search keeps: every
    mesh without a pipeline; one with ``P`` stages where ``P`` is at most the number of fast domains
    (a pipeline's bubble is pure loss, paid only where its hand-overs replace FSDP or
    data-parallel traffic on the slow link between domains: inside one, that traffic hides
    behind the compute), or where its state per device is below every such mesh's (the
    pipeline shards what no other axis can: 126 layers over 9 stages where no dimension divides by 9)."""
    domains = -(-devices // max(domain, 1))
    within = [sizes[PIPELINE] <= domains for sizes in found]
    least = min((st for st, w in zip(states, within) if w), default=math.inf)
    return [w or st < least * (1 - 1e-9) for w, st in zip(within, states)]


def mesh_state(config: Any, sizes: dict[str, int]) -> tuple[float, float, float]:
    """(parameter bytes per device, their compute-dtype bytes per layer before the FSDP split,
    gradient bytes all-reduced over the batch axes that do not split them), float32 parameters."""
    mesh = abstract_mesh(sizes)
    rules = type(config).axis_rules
    laid_out = parallel.layout_sizes(config, mesh)  # padded: a pipeline's padding layers, the vocabulary
    params = layer = reduced = 0.0
    for p in family_of(config).param_specs(config).values():
        n = math.prod(p.shape(laid_out))
        entries = parallel.param_axes(p, mesh, rules=rules, sizes=config.sizes)
        axes = [a for entry in entries for a in parallel.axis_names(entry)]
        split = math.prod(sizes[a] for a in axes)
        params += 4 * n / split
        if p.names and p.names[0].startswith("L") and p.names[0] in p.stacked:  # gathered over fsdp (and expert)
            layer += 2 * n / split * math.prod(sizes[a] for g in parallel.gather_axes(p, entries, rules=rules) for a in g)
        over = [a for a in ("data", "fsdp", "context", "expert") if sizes[a] > 1 and a not in axes]
        if over:
            reduced += 4 * n / split
    return params, layer, reduced


def quick_rows(config: Any, sizes: dict[str, int], seq_len: int, budget: float, dtype: Any) -> int:
    """Rows per device the quick model prices a mesh at: as many as the layer inputs full remat
    saves (the stage's on ``b + P - 1`` rows, one per tick, with a pipeline of ``P`` stages) fit
    in ``budget`` beside the state (a pipeline also holds a tick's gradients of its stage), at
    least one. (At one row an FSDP mesh's weight traffic looks exposed that a batch hides.)"""
    stages = sizes[PIPELINE]
    per_row = seq_len // sizes["context"] * config.sizes["D"] * jnp.dtype(dtype).itemsize
    counts = pipelined_layers(config) if stages > 1 else []
    stage = sum(-(-n // stages) for n in counts)
    rest = getattr(config, "num_layers", 1) - sum(counts)
    p_bytes = mesh_state(config, sizes)[0]
    room = budget - 4 * p_bytes - (p_bytes if stages > 1 else 0.0) - per_row * stage * (stages - 1)
    return int(max(1, min(room // (per_row * (stage + max(rest, 0))), 1 << 10)))


def quick_time(config: Any, sizes: dict[str, int], seq_len: int, hw: Hardware, dtype: Any, rows: int = 1) -> float:
    """Seconds of one step at ``rows`` sequences per batch shard, by the quick model (see the
    module); with a pipeline, ``rows`` micro-batches of one row on the GPipe schedule."""
    _, layer_bytes, reduced = mesh_state(config, sizes)
    shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    devices = math.prod(sizes.values())
    stages = sizes[PIPELINE]
    flops = config.flops_per_token(seq_len) * seq_len * 4 / 3  # a sequence's; full remat: +1 forward
    layers = getattr(config, "num_layers", 1)
    counts = pipelined_layers(config) if stages > 1 else []
    # Pipelined: the stage's layers run on rows + P - 1 rows (the bubble), the head's work is split
    # over the stages with the vocabulary, layers kept whole run on every stage; each layer's
    # share of the FLOPs taken alike.
    d, v = config.sizes["D"], config.vocab_size
    head = min(8 * v * d * seq_len, flops)
    per_layer = (flops - head) / layers
    ticks = rows + stages - 1
    stage_layers = sum(-(-n // stages) for n in counts)
    whole = per_layer * (layers - sum(counts))
    compute = (head * rows / stages + whole * rows + per_layer * stage_layers * ticks) * shards * stages / devices
    compute /= hw.peak_for(dtype) * hw.efficiency

    def t(kind: str, nbytes: int | float, axes: tuple[str, ...]) -> float:  # noqa: PYI041
        return collectives.collective_seconds(kind, nbytes, hw, sizes, axes)

    # FSDP: each layer gathered forward, re-gathered and its gradient reduce-scattered backward;
    # pipelined, the forward gathers of the stage run once, in a loop of their own (nothing to
    # hide behind), the backward's at every tick.
    if stages == 1:
        fsdp, exposed_fsdp = 3 * t("all_gather", layer_bytes, ("fsdp",)), 0.0
    else:
        gather = t("all_gather", layer_bytes, ("fsdp",))
        fsdp, exposed_fsdp = 2 * ticks * gather, gather
    over = tuple(a for a in ("data", "fsdp", "context", "expert") if sizes[a] > 1)
    grads = t("all_reduce", reduced, over) if over else 0.0
    tokens = seq_len // sizes["context"]
    item = jnp.dtype(dtype).itemsize
    layer_rows = stage_layers * ticks + (layers - sum(counts)) * rows if stages > 1 else layers * rows
    tensor = 6 * layer_rows * t("all_reduce", tokens * d * item, ("tensor",))
    a2a = 0.0
    k = getattr(config, "num_experts_per_tok", 0) or 0
    if sizes["expert"] > 1 and k:
        dense = getattr(config, "first_k_dense_replace", 0) or 0
        moe_rows = (stage_layers * ticks if stages > 1 else (layers - dense) * rows)
        # A round's slots hold capacity_factor x the routed rows (zoo.layers.moe_dispatch), at
        # most all of them, and a padded all-to-all moves them all; a ragged one (GPU, TPU) moves
        # the routed rows. The later rounds are priced as not run.
        ragged = Dispatch(transport=getattr(config, "moe_transport", "auto")).ragged(hw.platform)
        slots = 1.0 if ragged else min(sizes["expert"], getattr(config, "capacity_factor", 1.0))
        moved = slots * tokens * k * d * item
        a2a = 6 * moe_rows * t("all_to_all", moved, ("expert",))
    # The pipeline: a row handed on forward and its gradient back at every tick; all-reduced over
    # the stages, a row per row each for the last stage's output, the embedding's lookups, the
    # head's feature gradients and the stages' shared input's gradient.
    p2p = 0.0
    if stages > 1:
        row = tokens * d * item
        p2p = 2 * ticks * t("permute", row, (PIPELINE,)) + t("all_reduce", 4 * rows * row, (PIPELINE,))
    return compute + max(0.0, fsdp - compute) + exposed_fsdp + grads + tensor + a2a + p2p


def mesh_table(rows: list[MeshRow] | tuple[MeshRow, ...], limit: int = 12) -> str:
    """The searched meshes as aligned text: planned ones with their batch, memory, step time,
    MFU and tokens/s per device; dropped ones with why."""
    head = (f"{'mesh':<34} {'batch':>6} {'device GiB':>10} {'host GiB':>9} {'step s':>8} {'MFU':>6} "
            f"{'tok/s/dev':>9}  map / why")  # fmt: skip
    out = [head, "-" * len(head)]
    for r in list(rows)[:limit]:
        if r.batch_size:
            out.append(f"{r.mesh or 'one device':<34} {r.batch_size:>6} {r.device_bytes / 2**30:>10.1f} "
                       f"{r.host_bytes / 2**30:>9.1f} {r.step_time:>8.3g} {r.mfu:>6.1%} {r.tokens_per_s_device:>9.4g}"
                       f"  {_short_map(r.placement)}{_virtual(r)}")  # fmt: skip
        else:
            out.append(f"{r.mesh or 'one device':<34} {'-':>6} {'':>10} {'':>9} {'':>8} {'':>6} {'':>9}  "
                       f"{r.why or 'not planned (quick model ranks it lower)'}")  # fmt: skip
    if len(rows) > limit:
        out.append(f"... {len(rows) - limit} more meshes")
    return "\n".join(out)


def _virtual(r: MeshRow) -> str:
    return f" (virtual_stages={r.virtual_stages})" if r.virtual_stages > 1 else ""


def _short_map(spec: str) -> str:
    parts = [p for p in spec.split(",") if not p.endswith("=device")]
    return ",".join(parts) if parts else "everything on device"
