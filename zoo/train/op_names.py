"""Where a profiled op comes from, read off its ``op_name`` (the jax source path with its named
scopes, from the compiled step's HLO text): the decoder layers or the rest, forward, recomputed or
backward, and the named tensor (:mod:`zoo.layers.named`) whose scope holds it. Used by
:mod:`zoo.train.trace_report`.
"""

from __future__ import annotations

import functools
import re

from zoo.core.registry import families
from zoo.hooks.step import GATHERED
from zoo.layers.stack import LAYER_SCOPE

UNNAMED = "(unnamed, decoder layers)"  # a layer's ops that compute no named tensor alone
OUTSIDE = "(outside the layers)"
NO_SOURCE = "(no source)"  # an op missing from the step's HLO text


def hlo_sources(hlo: str) -> dict[str, str]:
    """Instruction name -> its ``op_name`` metadata (the jax source path, named scopes included)."""
    pattern = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name="([^"]*)"')
    return {m.group(1): m.group(2) for line in hlo.splitlines() if (m := pattern.match(line))}


def short_source(source: str, width: int = 90) -> str:
    """An op's source path without the step's and the loops' wrappers, its end kept."""
    text = re.sub(r"^jit\(\w+\)/", "", source)
    text = re.sub(r"(?:/|^)(?:while/body/|closed_call/|checkpoint/|remat/)+", "/", text).lstrip("/")
    return text if len(text) <= width else "..." + text[-(width - 3):]


def region(source: str) -> str:
    """Where an op's source lies: the decoder layers or the rest, forward or backward, or the update."""
    where = "decoder layers" if LAYER_SCOPE in source else "outside the layers"
    if "transpose(" in source:
        return f"{where}, backward"
    if "jvp(" in source:
        return f"{where}, forward"
    return "update and the rest" if source else "unattributed"


@functools.cache
def tensor_names() -> frozenset[str]:
    """Every named tensor's name, the scopes :func:`zoo.layers.named.named` opens: each family's
    placement-map fields, and FSDP's gathered weights."""
    return frozenset(n for family in families() for n in family.placement_map.names()) | {GATHERED}


def named_region(source: str, names: frozenset[str] | None = None) -> str:
    """The innermost named tensor whose scope holds an op (``source``: its ``op_name``), else
    :data:`UNNAMED` inside the decoder layers, :data:`OUTSIDE`, or :data:`NO_SOURCE`."""
    if not source:
        return NO_SOURCE
    names = tensor_names() if names is None else names
    path = source.rpartition("/")[0]  # the last part is the op itself
    # Transforms wrap scopes ("transpose(jvp(decoder_layer))/query/..."): split on both.
    for scope in reversed(re.split(r"[/()]", path)):
        if scope in names:
            return scope
    return UNNAMED if LAYER_SCOPE in source else OUTSIDE


def phase(source: str) -> str:
    """The pass an op belongs to: ``forward``, ``recompute`` (rematerialised for the backward
    pass), ``backward``, or ``other`` (the update, or no source)."""
    if "rematted_computation" in source:
        return "recompute"
    if "transpose(" in source:
        return "backward"
    return "forward" if "jvp(" in source else "other"
