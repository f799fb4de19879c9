"""Reading a lowered program's text: the host transfers it asks for, and a tensor's type as the
text spells it. ``zoo.train.verify`` counts them on the run's own step; ``zoo.plan.offloads``
on the CUDA export of a plan's step (the same count)."""

from __future__ import annotations

import collections
import functools
import re
from typing import Any

import jax.numpy as jnp

_FUNC = re.compile(r"^(\s*)func\.func (?:public|private) @([\w.$-]+)\(")
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call @([\w.$-]+)\(")
_ANNOTATE = re.compile(r'@annotate_device_placement\(.*_xla_buffer_placement = "(\w+)".*: \((tensor<[^>]*>)\) ->')


def host_moves(mlir: str) -> collections.Counter:
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


def tensor_type(s: Any) -> str:
    """The StableHLO type of an array of ``s``'s shape and dtype: ``tensor<4x16x64xbf16>``."""
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32"}[jnp.dtype(s.dtype).name]
    return f"tensor<{'x'.join(map(str, s.shape))}x{short}>"
