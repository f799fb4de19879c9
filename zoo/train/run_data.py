"""A run's data as ``recipes/train.py`` names it: the sources ``run.json`` keeps, the data
tokenized with the checkpoint's tokenizer, and how often the run goes through it
(:mod:`zoo.train.setup` re-exports these)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from zoo import data as zdata


def sources(data: str, checkpoint: str | None, text_field: str, data_format: str, *,
            checkpoint_id: str | None = None) -> dict[str, str | None]:  # fmt: skip
    """What the run is made from, as ``run.json`` keeps it (paths resolved, so that the same
    file named another way is the same source). A checkpoint given as a hub id
    (``checkpoint_id``, ``checkpoint`` its snapshot in the hub cache) is kept as the id, with the
    snapshot's revision (``checkpoint_revision``): the cache's path is this machine's, and the
    id resolves again on a resume."""
    if checkpoint_id is not None and checkpoint is not None:
        return {"data": _resolved(data), "checkpoint": checkpoint_id, "checkpoint_revision": Path(checkpoint).name,
                "text_field": text_field, "data_format": data_format}  # fmt: skip
    return {"data": _resolved(data), "checkpoint": _resolved(checkpoint), "text_field": text_field,
            "data_format": data_format}  # fmt: skip


def _resolved(name: str | None) -> str | None:
    if name is None:
        return None
    return ",".join(str(Path(n).resolve()) if Path(n).exists() else n for n in name.split(","))


def load_training_data(spec: str, vocab_size: int, *, checkpoint: str | None, seq_len: int, text_field: str = "text",
                       data_format: str = "auto", cache_dir: str | None = None) -> Any:  # fmt: skip
    """The data of ``--data``, tokenized with the checkpoint's tokenizer.json (bytes without one);
    says which tokenizer it uses. Data that cannot fill a row of ``seq_len`` is a ``ConfigError``."""
    # Many processes split the tokenizing (each its share of the records) and all read the
    # merged cache entry (zoo.data.Share); the cache directory is shared in a cluster.
    share = None
    if jax.process_count() > 1:
        share = zdata.Share(jax.process_index(), jax.process_count(), multihost_utils.sync_global_devices)
    tokenizer = zdata.load_tokenizer(checkpoint)
    print(f"tokenizer: {tokenizer.describe()}", flush=True)
    data = zdata.load_data(spec, vocab_size, tokenizer=tokenizer, text_field=text_field, data_format=data_format,
                           cache_dir=cache_dir, share=share)  # fmt: skip
    data.check(seq_len)
    return data


def count(n: int, unit: str) -> str:
    """``n`` things in units that fit: ``3,259 tokens``, ``1.2M tokens``, ``3.4B tokens``."""
    if n < 10**6:
        return f"{n:,} {unit}"
    return f"{n / 1e6:.1f}M {unit}" if n < 10**9 else f"{n / 1e9:.1f}B {unit}"


def epochs(data: Any, cfg: Any) -> str | None:
    """How often the run goes through its training data, in a line, where it is more than once
    (a small set is cycled without a word otherwise; ``None`` where the run sees it at most once):
    packed rows per epoch for packed documents, tokens for a token stream."""
    drawn = cfg.steps * cfg.grad_accum * cfg.batch_size  # rows
    if hasattr(data, "plan"):  # packed documents: every row once per epoch
        have, what = data.plan(cfg.seq_len, "train").num_rows, f"rows of {cfg.seq_len} tokens"
    else:  # windows drawn at random offsets: tokens
        have, what, drawn = data.num_tokens("train"), "tokens", drawn * cfg.seq_len
    if drawn <= have:
        return None
    return (f"data: the run takes {count(drawn, what)} ({cfg.steps} steps x {cfg.grad_accum * cfg.batch_size} rows) "
            f"from a train split of {count(have, what)}: about {drawn / have:,.1f} epochs, each row seen that often "
            "(more data, or fewer --steps, to see it less)")  # fmt: skip
