"""Where a run's trained model goes: ``--save-hf`` checked before the first step (never over
another run's export), the Hugging Face export with the checkpoint's tokenizer, and the run's
validation summary line (:mod:`zoo.train.setup` re-exports these for ``recipes/train.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from zoo import data as zdata
from zoo.errors import CheckpointError, ConfigError
from zoo.hf.save import check_save_path, save_pretrained
from zoo.train.run_dir import exported_to, record_export


def check_save_hf(target: str, *, checkpoint: str | None, run_dir: str, resume: bool = False,
                  overwrite_hf: bool = False) -> None:  # fmt: skip
    """``--save-hf``: a directory the trained model can go to, known before the first step: not a
    file, not under one, not the checkpoint being fine-tuned (its base weights would be
    replaced), not the run dir, and empty unless ``overwrite_hf`` or the resumed run's export."""
    where = Path(target).resolve()
    try:
        check_save_path(where)
    except CheckpointError as e:
        raise ConfigError(f"--save-hf {target}: {e}") from None
    if checkpoint and where == Path(checkpoint).resolve():
        raise ConfigError(f"--save-hf {target} is the --checkpoint being fine-tuned: saving there would replace its "
                          "base weights; choose another directory")  # fmt: skip
    if where == Path(run_dir).resolve():
        raise ConfigError(f"--save-hf {target} is the --run-dir; choose another directory "
                          f"(e.g. {Path(run_dir) / 'hf'})")  # fmt: skip
    held = sorted(p.name for p in where.iterdir()) if where.is_dir() else []
    if held and not overwrite_hf and not (resume and exported_to(run_dir) == where):
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(f"--save-hf {target} is not empty ({shown}) and not this run's own export: saving would "
                          "replace it; choose another directory, or --overwrite-hf to replace it")  # fmt: skip


def validation_summary(run_dir: str, history: Sequence[dict], resume: bool) -> str | None:
    """The run's first and last validation loss, the whole run's (``metrics.jsonl``) when resumed."""
    records = list(history)
    metrics = Path(run_dir) / "metrics.jsonl"
    if resume and metrics.is_file():  # the whole run's, not this session's
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    if not vals:
        return None
    return (f"validation loss: {vals[0]:.3f} -> {vals[-1]:.3f} (metrics: {run_dir}/metrics.jsonl, "
            f"curve: {run_dir}/loss.png)")  # fmt: skip


def copy_tokenizer(checkpoint: str | None, target: str) -> None:
    """The checkpoint's tokenizer files next to what a run writes from it (process 0 only), so
    recipes reading ``target`` tokenize as training did."""
    if checkpoint and jax.process_index() == 0:
        Path(target).mkdir(parents=True, exist_ok=True)
        zdata.copy_tokenizer_files(checkpoint, target)


def save_hf(model: Any, target: str, *, checkpoint: str | None, generation: dict | None, run_dir: str) -> None:
    """The trained model as a Hugging Face checkpoint in ``target`` (noted first in ``run_dir/hf-export.json``),
    with the fine-tuned checkpoint's sampling settings and tokenizer. Every process takes part (a
    sharded model is gathered tensor by tensor); process 0 writes and says so."""
    record_export(run_dir, target)
    save_pretrained(model, target, generation_config=generation or None)
    copy_tokenizer(checkpoint, target)
    if jax.process_index() == 0:
        print(f"saved {target}")
