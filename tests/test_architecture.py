"""The architecture holds: imports go down the layer table, and generic code never asks which
family it has.

Every import of a zoo module in ``zoo/``, ``recipes/`` and ``benchmarks/`` (function bodies
included) goes to a lower layer of :data:`LAYERS` (or stays inside its own unit); the README's
"Layout" section prints the same table. No generic module (``zoo/*.py``, ``zoo/layers``, ``zoo/hf``, ``zoo/train``, ``zoo/plan``,
``zoo/data``; the registry and the package face excepted) imports a family package or uses a name a family exports; every registered family
implements the whole protocol."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import zoo
from zoo import parallel
from zoo.core import registry
from zoo.core.protocol import CausalLM, ModelConfig

ZOO = Path(zoo.__file__).parent
ROOT = ZOO.parent

# Bottom to top. A unit is a top-level module or package of zoo (or a script folder); it may
# import its own modules and any unit of a lower layer, nothing at its layer or above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("errors", ("zoo.errors",)),
    ("what a model is", ("zoo.core",)),
    ("what model code calls inside the step", ("zoo.hooks",)),
    ("building blocks", ("zoo.layers", "zoo.loss", "zoo.placement", "zoo.hf", "zoo.data", "zoo.runtime",
                         "zoo.hardware", "zoo.cli")),
    ("the families", registry.FAMILY_PACKAGES),
    ("around the step", ("zoo.parallel", "zoo.generate", "zoo.lora")),
    ("training", ("zoo.train",)),
    ("planning", ("zoo.plan",)),
    ("the package face and old module paths", ("zoo", "zoo.causal_lm", "zoo.params", "zoo.registry",
                                               "zoo.pipeline", "zoo.vocab_parallel", "zoo.metrics_log")),
    ("scripts", ("recipes", "benchmarks")),
)  # fmt: skip
LEVEL = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}
# Modules kept only so that outside code's old imports work: nothing in zoo/ imports them.
OLD_PATHS = ("zoo.causal_lm", "zoo.params", "zoo.registry", "zoo.pipeline", "zoo.vocab_parallel", "zoo.metrics_log",
             "zoo.layers.named", "zoo.plan.hardware", "zoo.hf.pretrained")  # fmt: skip
# Imports deferred into a function body: only optional or heavy third-party packages, each
# loaded where it is used: a Parquet reader and saved datasets (the `data` extra), W&B (the
# `wandb` extra), orbax's checkpointer and TensorBoard's writer (a training run only), a
# checkpoint's tokenizer.json and chat template, the loss plot, the Pallas kernels of TPU and GPU, and
# huggingface_hub (the `hf` extra), which resolves a hub id given as a checkpoint (zoo.hf.hub).
DEFERRABLE = ("orbax", "tensorboardX", "pyarrow", "wandb", "datasets", "tokenizers", "jinja2", "matplotlib",
              "jax.experimental.pallas", "huggingface_hub")  # fmt: skip
SOURCES = sorted([*ZOO.rglob("*.py"), *(ROOT / "recipes").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")])


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p) for p in ZOO.rglob("*.py")}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] != "zoo" else ".".join(parts[:2])


def imports(path: Path):
    """``(line, imported zoo module, whether inside a function body)`` for every import of
    ``path``; ``from zoo import parallel`` imports ``zoo.parallel``, ``from zoo import lm_loss``
    the package face ``zoo``."""
    tree = ast.parse(path.read_text())
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deferred = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            targets = subs if len(subs) == len(node.names) else [base]
        else:
            continue
        for target in targets:
            yield node.lineno, target, id(node) in deferred


def test_the_layer_table_names_every_unit():
    units = {unit_of(m) for m in MODULES} | {"recipes", "benchmarks"}
    assert units == set(LEVEL), f"units missing from LAYERS: {sorted(units - set(LEVEL))}; gone: {sorted(set(LEVEL) - units)}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_the_layers(path):
    here = module_name(path)
    for line, target, _ in imports(path):
        if target.split(".")[0] != "zoo":
            continue
        there = unit_of(target)
        where = f"{path.relative_to(ROOT)}:{line} imports {target}"
        assert unit_of(here) == there or LEVEL[there] < LEVEL[unit_of(here)], (
            f"{where}: layer {LEVEL[there]} ({LAYERS[LEVEL[there]][0]}) is not below "
            f"layer {LEVEL[unit_of(here)]} ({LAYERS[LEVEL[unit_of(here)]][0]})"
        )
        if here.startswith("zoo.") and here not in OLD_PATHS:
            assert target not in OLD_PATHS, f"{where}, a module kept for old imports: import its new home"


@pytest.mark.parametrize("path", sorted(ZOO.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_optional_packages_are_imported_in_function_bodies(path):
    tree = ast.parse(path.read_text())
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(f):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                else:
                    assert not isinstance(node, ast.ImportFrom), f"{path.name}:{node.lineno}: a relative import"
                    continue
                for n in names:
                    assert any(n == d or n.startswith(d + ".") for d in DEFERRABLE), (
                        f"{path.relative_to(ROOT)}:{node.lineno} imports {n} inside {f.name}(): import it at the top"
                    )


def test_no_import_knot_among_the_units():
    """Tarjan's strongly connected components of the unit graph (function bodies included): none."""
    edges: dict[str, set[str]] = {}
    for path in ZOO.rglob("*.py"):
        for _, target, _ in imports(path):
            if target.startswith("zoo") and unit_of(target) != unit_of(module_name(path)):
                edges.setdefault(unit_of(module_name(path)), set()).add(unit_of(target))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    knots = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                knots.append(sorted([v, *component]))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not knots, f"import knots: {knots}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_crosses_a_package(path):
    """``from zoo.x import _name`` only inside the package that defines it (``zoo.plan`` may share
    its private helpers among its modules; ``zoo.train`` may not reach for them)."""
    here = module_name(path)
    home = here if path.name == "__init__.py" else here.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zoo"):
            source = node.module if node.module in MODULES and not (ZOO.parent / node.module.replace(".", "/") / "__init__.py").exists() else node.module + ".x"
            package = source.rpartition(".")[0]
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                assert not private or package == home, f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{alias.name}"
            assert not any(part.startswith("_") for part in node.module.split(".")) or node.module.rpartition(".")[0] == home, (
                f"{path.relative_to(ROOT)}:{node.lineno} imports the private module {node.module}"
            )


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.py")), ids=lambda p: p.name)
def test_recipes_name_no_family(path):
    """A recipe works for every family: it names none (their packages, classes or constants)."""
    names = family_names()
    packages = set(registry.FAMILY_PACKAGES)
    tree = ast.parse(path.read_text())
    for line, target, _ in imports(path):
        assert not any(target == p or target.startswith(p + ".") for p in packages), f"{path.name}:{line} imports {target}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            assert node.id not in names, f"{path.name}:{node.lineno} names {node.id} ({names[node.id]})"
        elif isinstance(node, ast.Attribute):
            assert node.attr not in names, f"{path.name}:{node.lineno} names .{node.attr} ({names[node.attr]})"
GENERIC = sorted(
    p for p in ZOO.rglob("*.py")
    if p != ZOO / "__init__.py" and not any(p.is_relative_to(ZOO / f.split(".")[1]) for f in registry.FAMILY_PACKAGES)
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


@pytest.mark.parametrize("first", ["zoo.plan.hardware", "zoo.plan"])
def test_old_paths_keep_their_names_whatever_is_imported_first(first):
    """Each old module still gives its names; ``zoo.plan.hardware`` is both an old module and the
    planner's function, and stays callable whichever a fresh process imports first."""
    script = f"""
import importlib, {first}
for old in {list(OLD_PATHS)!r}:
    importlib.import_module(old)
import zoo.plan
from zoo.plan import hardware
from zoo.plan.hardware import HARDWARE
assert zoo.plan.hardware("h100").name == hardware("h100").name == "h100" and "h100" in HARDWARE
from zoo.causal_lm import CausalLM; from zoo.params import Param; from zoo.registry import family_of
from zoo.pipeline import bubble; from zoo.hf.pretrained import from_pretrained
"""
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
