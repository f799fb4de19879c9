"""Terms a model wrapper adds to a named product, traced where the product runs.

A family's projections run through :func:`zoo.layers.fp8.matmul`, each under its precision
map's name (``"query"``, ``"mlp_down"``). A wrapper that needs a projection's input as well as
its weight (LoRA's dropout path: :mod:`zoo.lora.dropout`) opens a :func:`scope`, adds a term
under the product's name (:func:`add_term`), and the product adds ``term(spec, x, w)`` to its
result. :func:`zoo.layers.stack.scan_layers` opens one scope per layer body (traced, with the
1F1B schedule, outside the model's call), so a term added
while a layer's weights are computed is that layer's; outside the layer scans, the outermost
scope's terms apply (weights outside the stacks: DeepSeek-V3's MTP block). Only the innermost
scope is read: a layer's product never takes a term meant for a weight outside the stacks.

A term that no product took when its scope closes is an error: the weight it was added for is
read by something other than the named product (a routed expert's grouped matmul), so what the
term adds would be silently lost. No family code knows of these terms.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from jaxtyping import Array, Float

from zoo.errors import ConfigError

# (spec, x, w) -> the term added to ``einsum(spec, x, w)``, the product's shape and dtype.
Term = Callable[[str, Float[Array, "..."], Float[Array, "..."]], Float[Array, "..."]]


@dataclass
class _Scope:
    terms: dict[str, tuple[Term, str]] = field(default_factory=dict)  # name -> (term, what it is for)
    taken: set[str] = field(default_factory=set)


_SCOPES: contextvars.ContextVar[tuple[_Scope, ...]] = contextvars.ContextVar("zoo_product_terms", default=())


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """A scope for terms (a model call's, or one layer body's); on leaving it, a term that no
    product took is refused, naming what it was for."""
    s = _Scope()
    token = _SCOPES.set((*_SCOPES.get(), s))
    try:
        yield
    finally:
        _SCOPES.reset(token)
    missed = sorted(set(s.terms) - s.taken)
    if missed:
        what = ", ".join(f"{s.terms[n][1]} (product {n!r})" for n in missed)
        raise ConfigError(f"{what}: no zoo.layers.fp8.matmul of that name read the weight in this layer, so the "
                          "term for it would be lost (a weight read another way, such as a routed expert's)")  # fmt: skip


def add_term(name: str, term: Term, what: str) -> None:
    """Add ``term`` to the product ``name`` in the innermost open scope; ``what``: the weight it
    is for, for errors."""
    scopes = _SCOPES.get()
    if not scopes:
        raise RuntimeError("zoo.hooks.products.add_term outside a scope")
    terms = scopes[-1].terms
    if name in terms:
        raise ConfigError(f"{what} and {terms[name][1]} both add a term to the product {name!r} of one layer")
    terms[name] = (term, what)


def term_for(name: str) -> Term | None:
    """The term the innermost open scope holds for product ``name`` (marked taken), or ``None``."""
    scopes = _SCOPES.get()
    if not scopes or name not in scopes[-1].terms:
        return None
    scopes[-1].taken.add(name)
    return scopes[-1].terms[name][0]
