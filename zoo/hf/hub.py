"""Hugging Face hub ids as checkpoints: ``from_pretrained("org/name")`` where ``org/name`` is no
local folder resolves it as transformers does, to the snapshot ``huggingface_hub`` keeps in its
cache (downloading what is missing, unless ``HF_HUB_OFFLINE`` is set). ``huggingface_hub`` is
optional (the ``hf`` extra): imported only when an id is resolved."""

from __future__ import annotations

import os
import re
from pathlib import Path

from zoo.errors import CheckpointError

# A hub repository id: "namespace/name", each of letters, digits, '-', '_' and '.' (no ".."), at
# most 96 characters each. A bare "name" is taken as a local path.
HUB_ID = re.compile(r"(?!.*\.\.)\w[\w.-]{0,95}/\w[\w.-]{0,95}", re.ASCII)

# What a checkpoint holds that zoo reads: its config, weights, tokenizer and chat template.
FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model")


def is_hub_id(path: str | Path) -> bool:
    """Whether ``path`` reads as a hub id (``org/name``) rather than a local path."""
    return bool(HUB_ID.fullmatch(str(path)))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def resolve(path: str | Path) -> Path:
    """``path`` itself where it exists (or does not read as a hub id); else the hub id's snapshot
    folder in the hub cache (``HF_HUB_CACHE``; fetched unless ``HF_HUB_OFFLINE``). A
    :class:`CheckpointError` in one line where it cannot be had."""
    if Path(path).exists() or not is_hub_id(path):
        return Path(path)
    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointError(
            f"{path}: no such local folder; to load it as a Hugging Face hub id install huggingface_hub "
            "(pip install huggingface_hub, or zoo's hf extra)"
        ) from None
    offline = _offline()
    try:
        folder = huggingface_hub.snapshot_download(str(path), allow_patterns=list(FILES), local_files_only=offline,
                                                   cache_dir=os.environ.get("HF_HUB_CACHE"))  # fmt: skip
    except Exception as e:  # noqa: BLE001  (the hub client raises its own errors and the HTTP library's)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = "not in the hub cache and HF_HUB_OFFLINE is set" if offline else f"{type(e).__name__}: {why}"
        raise CheckpointError(f"{path}: no such local folder, and as a Hugging Face hub id it does not resolve "
                              f"({where})") from None  # fmt: skip
    return Path(folder)
