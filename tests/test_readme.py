"""The README's Python code blocks run as written, so a snippet cannot rot.

Each block runs in a fresh process from the repository root (the README's working directory),
on one CPU device, under strict dtype promotion as the suite: one block moves parameters to
pinned host memory, which XLA:CPU handles reliably only in a process of its own."""

from __future__ import annotations

import os
import re
import shlex
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


def _bash_block(after: str) -> list[str]:
    """The command lines of the first ``bash`` block after the heading ``after``, comments cut."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(after):], re.DOTALL)
    assert block is not None, f"no bash block after {after!r}"
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


def _shortened(args: list[str]) -> list[str]:
    """A README line made quick by flags the README shows: ``--steps`` (last given wins), small
    batches; evaluations of a few rows, a few generated tokens. ``--peak-tflops`` skips the
    recipe's 2-second matmul benchmark (the MFU's denominator), nine times over."""
    script = Path(args[1]).name
    if script == "train.py" and "--help" not in args:
        steps = "4" if "--resume" in args and "--steps" in args else "2"  # the longer resume extends the run
        return [*args, "--steps", steps, "--batch-size", "8", "--seq-len", "32", "--eval-every", "2", "--peak-tflops", "1"]
    return [*args, *{"eval.py": ["--max-rows", "8"], "generate.py": ["--max-new-tokens", "4"]}.get(script, [])]


def test_the_quick_start_then_the_recipes_block_run_top_to_bottom(tmp_path):
    """Issue 42: lines of the Recipes block were refused (a run dir an earlier line filled) or
    named files a fresh clone does not have. Each runs here as written, in order, from a folder
    laid out as the repository root, after the Quick start's main job."""
    for name in ("recipes", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "ZOO_CACHE_DIR": str(tmp_path / "cache")}
    quick = [line for line in _bash_block("## Quick start") if "recipes/train.py" in line]
    lines = [line[line.index("python"):] for line in quick] + _bash_block("## Recipes")
    assert len(lines) >= 12 and not any("path/to" in " ".join(line) for line in lines)
    for line in lines:
        args = [sys.executable, *_shortened(line)[1:]]
        out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
        assert out.returncode == 0, f"{' '.join(line)}:\n{out.stdout[-1500:]}\n{out.stderr[-3000:]}"
    assert (tmp_path / "runs" / "tuned" / "tokenizer.json").is_file()
