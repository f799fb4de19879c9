"""The README's Python code blocks run as written, so a snippet cannot rot.

Each block runs in a fresh process from the repository root (the README's working directory),
on one CPU device, under strict dtype promotion as the suite: one block moves parameters to
pinned host memory, which XLA:CPU handles reliably only in a process of its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


BLOCKS = python_blocks(ROOT / "README.md")
PRELUDE = 'import jax\njax.config.update("jax_numpy_dtype_promotion", "strict")\n'


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "JAX_ENABLE_COMPILATION_CACHE": "false"}
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(PRELUDE + BLOCKS[index])
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, f"README block {index}:\n{BLOCKS[index]}\n{out.stderr[-3000:]}"


def test_the_names_the_readme_prints_are_the_maps_names():
    """The README printed 11 of LlamaPlacement's 12 names (issue 42): its comment is checked."""
    import ast

    from zoo import LlamaPlacement

    text = (ROOT / "README.md").read_text()
    shown = re.search(r"zoo\.LlamaPlacement\.names\(\)\s+#\s*(\(.*?\))\n(?!\s*#)", text, re.DOTALL)
    assert shown is not None
    assert ast.literal_eval(re.sub(r"\n\s*#", "", shown.group(1))) == LlamaPlacement.names()
