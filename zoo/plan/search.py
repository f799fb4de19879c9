"""The mesh search: every mesh of a device count over zoo's axes, the most promising planned in full.

1. **Enumerate** every assignment of the device count to ``zoo.parallel.AXES`` that the model
   accepts (``zoo.parallel.validate_mesh`` is the divisibility oracle: when a layout change
   lets a dimension split further, the search sees it) and whose context axis cuts the
   sequence into equal chunks; a pipeline of ``P`` stages where each stage holds a real layer,
   and ``P`` is at most the number of fast domains or shards the state further than any mesh
   within that (:func:`worth_pipelining`).
2. **Prune by memory**: the parameters, gradients and AdamW moments per device under the mesh's
   layout (exact, from the parameter description) must fit the device and host budgets
   together, the gradients the device alone.
3. **Rank** by a quick model of the step at one sequence per device, or with a pipeline at
   :func:`quick_rows` one-row micro-batches on GPipe's schedule (:func:`quick_time`: compute at the hardware's
   efficiency, the bubble's ticks included, FSDP weight traffic beyond it, the gradient
   all-reduce over the axes that do not split a weight, tensor all-reduces, the all-to-alls'
   padded buffers and the pipeline's hand-overs, each on its link), then **plan in full**
   (:func:`zoo.plan.mesh_plan.plan_mesh`: traced memory, the map, the batch, collectives counted
   on the traced step, the interleaved schedule's virtual stages) the most promising, and keep the
   fastest. The quick model knows the state, not the activations: at its rows a mesh whose
   transient (gathered weights, an all-to-all's buffers) leaves room for one row looks far
   faster than it is. So the meshes are planned in turn from two rankings, the quick model's
   at its rows (until ``top`` have planned) and at one row per device (what any mesh that fits
   at all does at least; until ``top // 2`` have, at least one: :func:`plan_in_turn`): 671B on
   256 H200s, fsdp=128,tensor=2 ranks first at 87 rows and plans at 4 (198 tokens/s per device),
   fsdp=32,expert=8 ranks 57th at its rows, first at one row, and plans at 474. Then every mesh
   the quick model cannot rule out is planned too (:func:`plan_while_any_could_win`): while its
   figure, off by as much as the quick model was on any mesh planned, beats the fastest plan
   (there fsdp=64,tensor=2,expert=2, 58th of 1160 planned, at 488). The plan says how many
   meshes it planned (``Plan.meshes_planned``).

The enumeration, the pruning's state bytes, the quick model and the table are
:mod:`zoo.plan.meshes`'s (below the planner, which prices with them); :func:`search` is here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from zoo import parallel
from zoo.core.mesh import PIPELINE
from zoo.errors import ConfigError, MeshError
from zoo.hardware import Hardware
from zoo.hardware import hardware as lookup
from zoo.plan import _flops
from zoo.plan._step import abstract_model, mesh_spec
from zoo.plan.mesh_plan import NothingFits, plan_mesh
from zoo.plan.meshes import (
    MeshRow,
    factorizations,
    mesh_state,
    mesh_table,
    meshes,
    pipeline_sizes,
    pipelined_layers,
    quick_rows,
    quick_time,
    worth_pipelining,
)
from zoo.plan.offloads import verify_offloads
from zoo.plan.plans import _size

# zoo.plan.meshes's names, importable from here as before they moved below the planner (which prices with them).
__all__ = [
    "MeshRow", "factorizations", "mesh_state", "mesh_table", "meshes", "pipeline_sizes", "pipelined_layers",
    "plan_in_turn", "plan_while_any_could_win", "quick_rows", "quick_time", "search", "worth_pipelining",
]  # fmt: skip


def search(
    model_or_config: Any,
    *,
    devices: int,
    seq_len: int,
    hardware: str | Hardware | None,
    top: int = 5,
    compute_dtype: Any = None,
    pipeline: bool = True,
    **plan_kw: Any,
) -> Any:
    """The fastest plan over the meshes of ``devices`` (see the module; ``pipeline=False``: none
    with a pipeline axis); ``plan_kw``: the budgets, batch, margin and verification of
    :func:`zoo.plan.plan`. Raises
    :class:`~zoo.errors.MeshError` naming the dimensions when no mesh of ``devices`` divides
    the model, and :class:`~zoo.plan.NothingFits` (the table of meshes in its message) when
    none fits the budgets."""
    hw = lookup(hardware if hardware is not None else "cpu")
    model = abstract_model(model_or_config, compute_dtype)
    config = model.config
    dtype = model.compute_dtype
    found = [m for m in meshes(config, devices, seq_len) if pipeline or m[PIPELINE] == 1]
    if not found:
        sizes = {r.field: config.sizes[letter] for letter, r in type(config).axis_rules.items()}
        raise MeshError(
            f"no mesh of {devices} devices divides {type(config).__name__} at seq_len {seq_len}: every way of "
            f"writing {devices} as pipeline x data x fsdp x context x tensor x expert splits some dimension unevenly "
            f"({', '.join(f'{k} = {v}' for k, v in sizes.items())}); use a device count these divide"
        )
    margin = plan_kw.get("margin", 0.1)
    budget_d = float(
        hw.memory_per_device(devices) if plan_kw.get("device_budget") is None else plan_kw["device_budget"]
    ) * (1 - margin)
    budget_h = 0.0 if hw.unified else float(hw.host_bytes if plan_kw.get("host_budget") is None
                                            else plan_kw["host_budget"]) * (1 - margin)  # fmt: skip
    states = [mesh_state(config, sizes)[0] for sizes in found]
    keep = worth_pipelining(found, [4 * p for p in states], devices, hw.domain)
    found = [sizes for sizes, k in zip(found, keep) if k]
    states = [st for st, k in zip(states, keep) if k]
    bodies = _flops.layer_bodies(model, seq_len, plan_kw.get("precision"))
    # The quick model prices every matmul at the compute dtype's peak: with a precision map, its
    # FP8 products' share runs at the FP8 peak (as CostModel prices them), so its bounds stay optimistic.
    share = _flops.fp8_share(bodies, config.flops_per_token(seq_len) * seq_len, hw.block_scaled_fp8)
    faster = _flops.fp8_slowdown(share, hw.peak_for(jnp.float8_e4m3fn) / hw.peak_for(dtype))
    rows: list[MeshRow] = []
    one_row: dict[str, float] = {}  # mesh -> the quick model's seconds at one row per device
    for sizes, p_bytes in zip(found, states):
        state = 4 * p_bytes
        shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
        given = plan_kw.get("batch_size")
        b = max(given // shards, 1) if given else quick_rows(config, sizes, seq_len, budget_d + budget_h, dtype)
        quick = quick_time(config, sizes, seq_len, hw, dtype, rows=b) / b * faster
        one_row[mesh_spec(sizes)] = quick if given or b == 1 else quick_time(config, sizes, seq_len, hw, dtype) * faster
        why = ""
        if p_bytes > budget_d or state > budget_d + budget_h:
            why = f"state {state / 2**30:.0f} GiB per device"
        rows.append(MeshRow(mesh_spec(sizes), float(state), float(quick), why=why))

    # Seconds per token: a step of one sequence per batch shard.
    def per_token(r: MeshRow) -> float:
        return r.quick / _shards(r.mesh)

    if not (isinstance(top, int) and top >= 1):
        raise ConfigError(f"plan: top (the meshes planned in full) must be a positive integer, got {top!r}")
    live = sorted((r for r in rows if not r.why), key=per_token)
    planned, found_plans = [], {}
    closest: list[Any] = [None, ""]  # the planned mesh nearest to fitting: its smallest peak, and why

    def attempt(r: MeshRow) -> bool:
        try:
            p = plan_mesh(model, mesh=r.mesh or None, seq_len=seq_len, hardware=hw, bodies=bodies,
                          **{**plan_kw, "verify": False})  # fmt: skip
        except NothingFits as e:
            planned.append(dataclasses.replace(r, why=str(e).split(":")[0] + " (activations)"))
            if e.device_peak and (closest[0] is None or e.device_peak < closest[0]):
                closest[:] = [e.device_peak, f"{r.mesh}: {str(e).split(': ', 1)[1]}"]
            return False
        except MeshError as e:  # a pipeline the family cannot stage (Qwen3's blocks must line up)
            planned.append(dataclasses.replace(r, why=str(e)[:120]))
            return False
        planned.append(dataclasses.replace(
            r, batch_size=p.batch_size, device_bytes=float(p.estimate.device_bytes), host_bytes=float(p.estimate.host_bytes),
            step_time=p.step_time, mfu=p.mfu, tokens_per_s_device=p.tokens_per_s / devices,
            placement=p.placement.spec(), virtual_stages=p.virtual_stages,
        ))  # fmt: skip
        found_plans[r.mesh] = p
        return True

    by_one_row = sorted(live, key=lambda r: one_row[r.mesh] / _shards(r.mesh))
    tried = plan_in_turn(live, by_one_row, top, attempt)

    # The quick model's most optimistic seconds per token of a mesh: at its rows or at one row.
    def optimistic(r: MeshRow) -> float:
        return min(per_token(r), one_row[r.mesh] / _shards(r.mesh))

    tried, unruled = plan_while_any_could_win(live, tried, optimistic,
                                              lambda: {m: p.tokens_per_s for m, p in found_plans.items()}, attempt,
                                              limit=top)  # fmt: skip
    best = max(found_plans.values(), key=lambda p: p.tokens_per_s, default=None)
    others = [r for r in rows if r not in tried]
    if best is None:
        table = mesh_table(planned + sorted(others, key=lambda r: r.state_bytes)[:5])
        smallest = min(rows, key=lambda r: r.state_bytes)
        replicas = min(s["data"] for s in found)
        why = (
            f"; {devices} = {devices // replicas} x {replicas} and no dimension of the model divides by {replicas}: "
            f"every mesh keeps {replicas} data-parallel replicas of the state, sharded only {devices // replicas} ways"
            if replicas > 1 else ""
        )  # fmt: skip
        raise NothingFits(
            f"no mesh of {devices} {hw.name} fits: the smallest state is {_size(smallest.state_bytes)} per "
            f"device (parameters, gradients and AdamW moments on {smallest.mesh or 'one device'}) against "
            f"{_size(budget_d)} device and {_size(budget_h)} host usable{why}"
            + (f"; the state fits on some meshes, their activations do not: the nearest, {closest[1]}" if closest[1]
               else "") + f"\n{table}"
        )
    if plan_kw.get("verify", True):
        best = dataclasses.replace(best, offloaded_verified=verify_offloads(model, best.placement, seq_len)
                                   if hw.host_link > 0 and not hw.unified else ())  # fmt: skip
    chosen = next(r for r in planned if r.mesh == best.mesh)
    ranked = [chosen] + sorted((r for r in planned if r is not chosen), key=lambda r: -r.tokens_per_s_device)
    return dataclasses.replace(best, meshes=tuple(ranked + sorted(others, key=per_token)), meshes_planned=len(tried),
                               meshes_unruled=unruled, search_top=top)  # fmt: skip


def _shards(mesh: str) -> int:
    s = parallel.parse_mesh(mesh)
    return s["data"] * s["fsdp"] * s["expert"]


def plan_while_any_could_win(live: list[MeshRow], tried: list[MeshRow], quick: Any, full: Any, attempt: Any, *,
                             limit: int) -> tuple[list[MeshRow], int]:  # fmt: skip
    """``tried`` and after them, fastest by the quick model first, up to ``limit`` meshes of
    ``live`` the quick model cannot rule out: ``quick(row)`` its seconds per token, ``full()`` the
    tokens/s of the meshes planned so far that fit (by mesh), ``attempt(row)`` plans one. The
    quick model's error is measured on the planned meshes, as full tokens/s x quick seconds per
    token (a constant where it were exact), and a mesh is planned while that margin at its
    largest, over its quick seconds, beats the fastest plan: no mesh left unplanned could, by
    the quick model off by as much as it has been. (The margin and the fastest plan are retaken
    after each plan.) Also returns how many such meshes the ``limit`` left unplanned (each full
    plan costs seconds: 671B on 256 H200 has 47 of them, 12 minutes on 2 cores)."""
    tried = list(tried)
    done = {r.mesh for r in tried}
    rows = {r.mesh: r for r in live}
    todo = sorted((r for r in live if r.mesh not in done), key=quick)
    for i, r in enumerate(todo):
        figures = full()
        if not figures:  # nothing planned fits: no margin measured (the search says what did not fit)
            return tried, 0
        margin = max(f * quick(rows[m]) for m, f in figures.items())
        if margin / quick(r) <= max(figures.values()):
            return tried, 0  # the later ones, slower by the quick model, cannot either
        if limit <= 0:
            return tried, sum(margin / quick(x) > max(figures.values()) for x in todo[i:])
        limit -= 1
        tried.append(r)
        attempt(r)
    return tried, 0


def plan_in_turn(by_rows: list[MeshRow], by_one_row: list[MeshRow], top: int, attempt: Any) -> list[MeshRow]:
    """The meshes the search plans in full, in order (``attempt(row)`` plans one, True where it
    fits): from the quick model's ranking at its rows until ``top`` have planned, and from its
    ranking at one row per device until ``max(1, top // 2)`` have, taken in turn, each ranking
    at most ``top + 4`` tries (a failed try traces, no more); a mesh planned for one ranking
    counts for the other where it comes up there."""
    queues = {"rows": list(by_rows), "one": list(by_one_row)}
    quota = {"rows": top, "one": max(1, top // 2)}
    fits: dict[str, bool] = {}
    done = dict.fromkeys(queues, 0)
    tries = dict.fromkeys(queues, 0)
    tried: list[MeshRow] = []
    progressed = True
    while progressed:
        progressed = False
        for k, queue in queues.items():
            while queue and queue[0].mesh in fits:  # planned for the other ranking
                done[k] += fits[queue.pop(0).mesh]
            if done[k] >= quota[k] or tries[k] >= top + 4 or not queue:
                continue
            r = queue.pop(0)
            tries[k] += 1
            tried.append(r)
            fits[r.mesh] = bool(attempt(r))
            done[k] += fits[r.mesh]
            progressed = True
    return tried
