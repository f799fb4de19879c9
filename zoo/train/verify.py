"""Placements proven in the run itself, before its first step: every tensor the placement map
offloads moves to pinned host memory in the compiled train step, and every tree placed in host
memory (parameters, optimizer state) is taken and returned there. Otherwise the run stops with
a :class:`~zoo.errors.ConfigError` naming the tensor, before anything is trained.

The per-name count (:mod:`zoo.train.hlo`) is the one ``zoo.plan`` checks in a CUDA export at
planning time (``annotate_device_placement`` custom calls of each offloaded name's tensor type),
here on the real step: its mesh, batch, attention path and memory kinds. XLA:CPU has one memory and jax
lowers no transfers for it, so on CPU the step is lowered for CUDA to count them; on an
accelerator the lowering that is compiled is counted, and the compiled program must hold a
buffer of each name's element type in host memory (memory space 5).
"""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import numpy as np

from zoo.errors import ConfigError
from zoo.placement import names_in, resolve
from zoo.train.hlo import host_moves, tensor_type

# XLA's host memory space in a compiled program's layouts: ``f32[4,2,16,64]{3,2,1,0:S(5)}``.
_HOST_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]\{[^}]*S\(5\)")
_XLA_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32", "float64": "f64"}


def host_arrays(hlo: str) -> collections.Counter:
    """``(element type, element count)`` of every array the compiled program ``hlo`` keeps in host
    memory, computed or copied there (the module's header and its parameters left out)."""
    found: collections.Counter = collections.Counter()
    for line in hlo.splitlines():
        if line.startswith("HloModule") or " parameter(" in line:
            continue
        for kind, dims in _HOST_ARRAY.findall(line):
            found[kind, int(np.prod([int(d) for d in dims.split(",") if d]))] += 1
    return found


def check_offloads(traced: Any, lowered: Any, compiled: Any, placement: Any, model: Any, platform: str) -> tuple[str, ...]:
    """The names ``placement`` offloads, each checked to move to pinned host memory in the step
    ``traced`` / ``lowered`` / ``compiled`` on ``platform``; a ConfigError names any that does not."""
    if placement is None:
        return ()
    offloaded = resolve(placement, model).placed("pinned_host")
    if not offloaded:
        return ()
    shapes: dict[str, jax.ShapeDtypeStruct] = {}
    for name, s in names_in(traced.jaxpr):
        shapes.setdefault(name, s)
    absent = [n for n in offloaded if n not in shapes]
    if absent and jax.process_index() == 0:  # a map shared by a family's variants (Qwen3's dense and MoE layers)
        print(f"note: the placement map offloads {', '.join(absent)}, which this model's step never computes "
              "(another variant's tensors, or ones its attention path keeps inside its kernel): nothing to move",
              flush=True)  # fmt: skip
    offloaded = tuple(n for n in offloaded if n in shapes)
    if not offloaded:
        return ()
    unified = platform == "cpu"
    text = traced.lower(lowering_platforms=("cuda",)).as_text() if unified else lowered.as_text()
    to_host = collections.Counter({t: n for (where, t), n in host_moves(text).items() if where == "pinned_host"})
    need = collections.Counter(tensor_type(shapes[n]) for n in offloaded)
    where = "the step's CUDA lowering (XLA:CPU has one memory: it lowers no transfers)" if unified else "the step"
    missing = [n for n in offloaded if to_host[tensor_type(shapes[n])] < need[tensor_type(shapes[n])]]
    if missing:
        raise ConfigError(
            f"the placement map offloads {', '.join(missing)} but {where} moves no such tensor "
            f"({', '.join(tensor_type(shapes[n]) for n in missing)}) to pinned host memory: the offload would "
            "silently not happen (a checkpoint policy replaced, or the tensor is not kept for the backward pass)"
        )
    if not unified:
        held = host_arrays(compiled.as_text())
        for n in offloaded:
            kind = _XLA_TYPES.get(np.dtype(shapes[n].dtype).name, np.dtype(shapes[n].dtype).name)
            size = int(np.prod(shapes[n].shape))
            if not any(k == kind and c % size == 0 for k, c in held):
                raise ConfigError(
                    f"the placement map offloads {n} ({tensor_type(shapes[n])}), and the step asks for it, but the "
                    f"compiled program keeps no {kind} buffer of its size in host memory: XLA dropped the offload "
                    "(are xla_gpu_enable_host_memory_offloading and the step's XLA options in effect?)"
                )
    return offloaded


def check_trees(compiled: Any, param_memory: str, opt_memory: str) -> None:
    """Parameters / optimizer state placed in ``pinned_host`` must be the compiled step's arguments
    and results in pinned host memory; a ConfigError names the first leaf that is not."""
    args, results = compiled.input_shardings[0], compiled.output_shardings
    for what, memory, index in (("parameters", param_memory, 0), ("optimizer state", opt_memory, 1)):
        if memory != "pinned_host":
            continue
        for role, tree in (("takes", args[index]), ("returns", results[index])):
            for path, sharding in jax.tree_util.tree_flatten_with_path(tree)[0]:
                kind = getattr(sharding, "memory_kind", None)
                if kind != "pinned_host":
                    raise ConfigError(
                        f"{what} are placed in pinned_host, but the compiled step {role} "
                        f"{what}{jax.tree_util.keystr(path)} in {kind} memory"
                    )


def check_step(step_fn: Any, args: tuple, *, placement: Any, model: Any, param_memory: str, opt_memory: str,
               platform: str) -> Any:  # fmt: skip
    """Compile ``step_fn`` for ``args`` (the compile the run's steps then reuse), check its
    placements and say what was proven; returns the compiled step."""
    traced = step_fn.trace(*args)
    lowered = traced.lower()
    compiled = lowered.compile()
    check_trees(compiled, param_memory, opt_memory)
    offloaded = check_offloads(traced, lowered, compiled, placement, model, platform)
    trees = [what for what, memory in (("parameters", param_memory), ("optimizer state", opt_memory)) if memory != "device"]
    said = ([f"{', '.join(offloaded)} offloaded to pinned host memory"] if offloaded else []) + (
        [f"{' and '.join(trees)} in pinned host memory"] if trees else [])  # fmt: skip
    if said and jax.process_index() == 0:
        print(f"placements checked in the compiled step: {'; '.join(said)}", flush=True)
    return compiled
