"""What a resume may change: a run's settings (``run.json``) compared with the resumed run's,
each difference refused unless named (``--allow-change``) or free (:data:`FREE_ON_RESUME`), and
the learning-rate schedule a longer resume keeps (:func:`keep_schedule`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from zoo.errors import RunDirError
from zoo.train.config import TrainConfig, learning_rate
from zoo.train.metrics import jsonable

# What a resume may change without a word: where things live and how often the loop reports,
# none of which changes the numbers trained. Everything else in run.json is compared.
FREE_ON_RESUME = ("mesh", "placement", "param_memory", "opt_memory", "log_every", "eval_every", "eval_batches",
                  "checkpoint_every", "keep_checkpoints", "model_config.attention")  # fmt: skip


def _comparable(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A run's settings (run.json) as ``{name: value}``, by the names ``--allow-change`` takes:
    TrainConfig fields and the family's training options by their own names, the model's
    config fields as ``model_config.NAME``, and the rest (``model``, ``param_dtype``, ``data``,
    ``checkpoint`` ...) as they are."""
    out: dict[str, Any] = {}
    pipelined = int((settings.get("mesh") or {}).get("pipeline", 1)) > 1
    for name, value in settings.items():
        if name == "train":
            for field, v in value.items():
                if field in ("microbatches", "virtual_stages", "schedule") and not pipelined:
                    continue  # they do nothing without a pipeline axis (runs of before 2026-12-03 recorded them)
                if field == "model_options" and isinstance(v, Mapping):
                    out.update(v)
                else:
                    out[field] = v
            if "steps" in value:  # the decay's end as it is (None, or not recorded: at steps)
                out["decay_steps"] = value.get("decay_steps") or value["steps"]
        elif name in ("model_config", "sources") and isinstance(value, Mapping):
            out.update({(f"model_config.{k}" if name == "model_config" else k): v for k, v in value.items()})
        else:
            out[name] = value
    return out


def keep_schedule(run_dir: Path, cfg: TrainConfig, start: int, allow_change: Iterable[str] = ()
                  ) -> tuple[TrainConfig, str | None]:  # fmt: skip
    """A resume's ``cfg`` on the learning-rate schedule the run had: its cosine decay ends where
    the run's did (``run.json``), so a resume with more ``steps`` goes on at the final lr rather
    than stretching the decay (which would raise the lr again), unless ``decay_steps`` is in
    ``allow_change`` (or ``cfg.decay_steps`` is set). Returns the config and, where ``steps``
    changes, the line that says what the schedule does from step ``start + 1``."""
    if start == 0:  # no step trained on the run's schedule (no checkpoint): the run starts over on this one
        return cfg, None
    try:
        before = json.loads((run_dir / "run.json").read_text())["train"]
        steps, end = int(before["steps"]), int(before.get("decay_steps") or before["steps"])
        had = {k: before[k] for k in ("warmup", "lr", "min_lr_ratio") if k in before}
        old = dataclasses.replace(cfg, steps=steps, decay_steps=end, **had)  # the run's own schedule
    except (OSError, ValueError, KeyError, TypeError):
        return cfg, None  # nothing to keep (check_resume says what is wrong with run.json)
    stretch = "decay_steps" in {n.replace("-", "_") for n in allow_change} or end < cfg.warmup  # (a longer warm-up)
    if cfg.decay_steps is None and not stretch and end != cfg.steps:
        cfg = dataclasses.replace(cfg, decay_steps=end)
    if steps == cfg.steps:
        return cfg, None
    new_end = cfg.steps if cfg.decay_steps is None else cfg.decay_steps
    if new_end == end:
        after = (f"steps {end + 1}-{cfg.steps} go on at its final lr {float(learning_rate(cfg)(end)):.2e}"
                 if cfg.steps > end else f"the run stops at step {cfg.steps}, before the decay ends")  # fmt: skip
        return cfg, (f"learning rate: the schedule keeps its length: its decay ends at step {end} as before, and {after} "
                     f"(--allow-change steps,decay_steps would stretch the decay to step {cfg.steps})")  # fmt: skip
    return cfg, (f"learning rate: the decay now ends at step {new_end}, not {end}: step {start + 1} trains at lr "
                 f"{float(learning_rate(cfg)(start)):.2e}, the run's schedule had {float(learning_rate(old)(start)):.2e}")  # fmt: skip


def check_resume(run_dir: Path, settings: Mapping[str, Any], allow_change: Iterable[str] = ()) -> dict[str, tuple]:
    """Refuse (``RunDirError``) a resume whose settings differ from those the run was made with
    (``run_dir/run.json``), listing the differences, unless each is in ``allow_change`` or
    :data:`FREE_ON_RESUME`. Returns the allowed changes, ``{name: (before, now)}``."""
    file = run_dir / "run.json"
    if not file.is_file():  # a run from before run.json: nothing to compare with
        return {}
    try:
        before = _comparable(json.loads(file.read_text()))
    except (OSError, ValueError, AttributeError) as e:
        raise RunDirError(f"{file}: the run's settings do not read ({e}); --overwrite to start over") from None
    now = _comparable(jsonable(dict(settings)))
    allow = {name.replace("-", "_") for name in allow_change}
    if unknown := sorted(allow - set(now) - set(before)):
        raise RunDirError(f"--allow-change {','.join(unknown)}: not a setting of this run; its settings are "
                          f"{', '.join(sorted(set(now) - set(FREE_ON_RESUME)))}")  # fmt: skip
    # Names in one of the two only are settings a zoo of another version did not record: not compared.
    changed = {name: (before[name], now[name]) for name in sorted(set(before) & set(now))
               if name not in FREE_ON_RESUME and before[name] != now[name]}  # fmt: skip
    refused = {name: v for name, v in changed.items() if name not in allow}
    if refused:
        listed = ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in refused.items())
        raise RunDirError(
            f"--resume would change the settings the run in {run_dir} was made with ({file.name}): {listed}. "
            f"Resume with the run's own settings, or say which may change: --allow-change {','.join(refused)}"
        )
    return changed
