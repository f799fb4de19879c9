"""Verifying a plan's offloads: every offloaded name really moves to pinned host memory in the
CUDA export of the step (``zoo.train.verify`` shares the count)."""

from __future__ import annotations

import collections
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp

from zoo.errors import ConfigError
from zoo.placement import PlacementMap
from zoo.plan._step import SDS

_FUNC = re.compile(r"^(\s*)func\.func (?:public|private) @([\w.$-]+)\(")
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call @([\w.$-]+)\(")
_ANNOTATE = re.compile(r'@annotate_device_placement\(.*_xla_buffer_placement = "(\w+)".*: \((tensor<[^>]*>)\) ->')


def _host_moves(mlir: str) -> collections.Counter:
    """``(placement, tensor type)`` of every ``annotate_device_placement`` the program runs from
    ``main``, through its calls (as ``tests/test_placement.py`` counts them)."""
    lines = mlir.splitlines()

    def close(start: int) -> int:
        ind = len(lines[start]) - len(lines[start].lstrip())
        return next(i for i in range(start + 1, len(lines))
                    if len(lines[i]) - len(lines[i].lstrip()) == ind and lines[i].lstrip().startswith("}"))  # fmt: skip

    funcs = {m.group(2): (i, close(i)) for i, line in enumerate(lines) if (m := _FUNC.match(line))}

    @functools.cache
    def in_func(name: str) -> collections.Counter:
        a, b = funcs[name]
        found: collections.Counter = collections.Counter()
        for line in lines[a + 1 : b]:
            if m := _ANNOTATE.search(line):
                found[m.groups()] += 1
            for callee in _CALL.findall(line):
                if callee in funcs:
                    found += in_func(callee)
        return found

    return in_func("main")


def _tensor_type(s: Any) -> str:
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32"}[jnp.dtype(s.dtype).name]
    return f"tensor<{'x'.join(map(str, s.shape))}x{short}>"


def verify_offloads(model: Any, placement: PlacementMap, seq_len: int) -> tuple[str, ...]:
    """The offloaded names, each checked to move to pinned host memory in the CUDA export of
    one sequence's forward and backward pass; a ConfigError names any that does not."""
    import equinox as eqx

    offloaded = placement.placed("pinned_host")
    if not offloaded:
        return ()
    ids = SDS((1, seq_len), jnp.int32)

    def f(m, x):
        return eqx.filter_value_and_grad(lambda m: m.loss(x, placement=placement)[0])(m)

    shapes: dict[str, Any] = {}
    counts: collections.Counter = collections.Counter()
    from zoo.placement import named_tensors

    for name, s in named_tensors(lambda m, x: m.loss(x, placement=placement)[0], model, ids):
        shapes.setdefault(name, s)
        counts[name] += 1
    mlir = jax.export.export(jax.jit(f), platforms=["cuda"])(model, ids).mlir_module()
    moves = _host_moves(mlir)
    to_host = collections.Counter({t: n for (where, t), n in moves.items() if where == "pinned_host"})
    need: collections.Counter = collections.Counter()
    for name in offloaded:
        if name in shapes:
            need[_tensor_type(shapes[name])] += 1
    missing = [n for n in offloaded if n in shapes and to_host[_tensor_type(shapes[n])] < need[_tensor_type(shapes[n])]]
    if missing:
        raise ConfigError(f"the plan offloads {missing} but the CUDA export moves no such tensor to pinned host memory")
    return tuple(n for n in offloaded if n in shapes)
