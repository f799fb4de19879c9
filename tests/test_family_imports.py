"""A family's modules import zoo at their top: no function body imports from zoo (an import
deferred into a method hid a cycle between a family's model and its decoding)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zoo
from zoo import registry

ZOO = Path(zoo.__file__).parent
FAMILY_FILES = sorted(p for name in registry.FAMILY_PACKAGES for p in (ZOO / name.split(".")[1]).glob("*.py"))


def _zoo_imports(node: ast.AST) -> list[int]:
    def modules(sub: ast.AST) -> list[str]:
        if isinstance(sub, ast.ImportFrom):
            return [sub.module or ""]
        return [a.name for a in sub.names] if isinstance(sub, ast.Import) else []

    return [sub.lineno for sub in ast.walk(node) if any(m.split(".")[0] == "zoo" for m in modules(sub))]


@pytest.mark.parametrize("path", FAMILY_FILES, ids=[str(p.relative_to(ZOO)) for p in FAMILY_FILES])
def test_no_function_body_imports_from_zoo(path):
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    deferred = sorted({line for f in functions for line in _zoo_imports(f)})
    assert not deferred, f"{path.relative_to(ZOO)} imports from zoo inside a function at lines {deferred}"
