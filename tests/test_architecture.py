"""The architecture holds: generic code never asks which family it has.

No generic module (``zoo/*.py``, ``zoo/layers``, ``zoo/hf``, ``zoo/train``, ``zoo/plan``,
``zoo/data``; the registry and the package face excepted) imports a family package or uses a name a family exports; every registered family
implements the whole protocol."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import zoo
from zoo import parallel, registry
from zoo.causal_lm import CausalLM, ModelConfig

ZOO = Path(zoo.__file__).parent
EXEMPT = {"__init__.py", "registry.py"}
GENERIC = sorted(
    p for p in [*ZOO.glob("*.py"), *(ZOO / "layers").glob("*.py"), *(ZOO / "hf").glob("*.py"),
                *(ZOO / "train").glob("*.py"), *(ZOO / "plan").glob("*.py"), *(ZOO / "data").glob("*.py")]
    if p.name not in EXEMPT
)  # fmt: skip


def family_names() -> dict[str, str]:
    """Every class or function a family package defines and exports -> the package (not the
    shared layers it re-exports, nor the generic words every family uses)."""
    out = {}
    for package in registry.FAMILY_PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            defined_in = getattr(getattr(module, name), "__module__", "") or ""
            if defined_in.startswith(package) and name not in ("preset", "route"):
                out[name] = package
    return out


def test_every_family_package_is_registered():
    assert {c.__module__.rsplit(".", 1)[0] for c in registry.families()} == set(registry.FAMILY_PACKAGES)


@pytest.mark.parametrize("path", GENERIC, ids=[str(p.relative_to(ZOO)) for p in GENERIC])
def test_generic_modules_do_not_know_the_families(path):
    tree = ast.parse(path.read_text())
    names = family_names()
    packages = set(registry.FAMILY_PACKAGES)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not any(node.module == p or node.module.startswith(p + ".") for p in packages), (
                f"{path.name}:{node.lineno} imports {node.module}"
            )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert not any(alias.name == p or alias.name.startswith(p + ".") for p in packages), (
                    f"{path.name}:{node.lineno} imports {alias.name}"
                )
        elif isinstance(node, ast.Name):
            assert node.id not in names, f"{path.name}:{node.lineno} names {node.id} ({names[node.id]})"
        elif isinstance(node, ast.Attribute):
            assert node.attr not in names, f"{path.name}:{node.lineno} names .{node.attr} ({names[node.attr]})"


@pytest.mark.parametrize("cls", registry.families(), ids=lambda c: c.__name__)
def test_every_family_implements_the_protocol(cls):
    assert issubclass(cls, CausalLM) and issubclass(cls.config_cls, ModelConfig)
    assert not inspect.isabstract(cls) and not inspect.isabstract(cls.config_cls)
    assert cls.model_types and all(registry.by_model_type(t) is cls for t in cls.model_types)
    assert cls.placement_map.model.endswith(cls.__name__)
    assert set(cls.config_cls.axis_rules) and all(
        set(parallel.axis_names(r.mesh_axis)) <= set(parallel.AXES) for r in cls.config_cls.axis_rules.values()
    )
    for t in cls.model_types:
        config = cls.config_cls.preset("tiny", t)
        assert registry.family_of(config) is cls
        letters = {a for p in cls.param_specs(config).values() for a in p.names}
        assert set(cls.config_cls.axis_rules) <= letters | set(config.sizes)  # every rule's letter is in the legend


def test_unknown_model_type_lists_the_registered_ones():
    with pytest.raises(zoo.ConfigError, match=r"unknown model_type 'gpt2'; zoo supports \['deepseek_v3', 'llama', 'qwen3', 'qwen3_moe'\]"):
        registry.by_model_type("gpt2")
