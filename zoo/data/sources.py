"""Where documents come from: text files, JSON lines, Parquet, saved Hugging Face datasets and
datasets on the Hugging Face hub (``hf:NAME``), as records ``(fields, where, split)`` with
``where`` naming the file and line or row for errors; and how a record becomes a document
(text, chat or prompt/completion).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.data.tokenizer import ROLES, DataError

JSON_LINES = (".jsonl", ".json")
PARQUET = (".parquet",)
FORMATS = ("auto", "text", "chat", "completion")
HUB = "hf:"  # --data hf:NAME or hf:NAME:CONFIG, a dataset on the hub (or a local folder in its layout)


@dataclass(frozen=True)
class Source:
    """One ``--data`` entry: ``kind`` is "text", "jsonl", "parquet", "dataset" (a directory
    written by ``datasets.Dataset.save_to_disk``) or "hub" (``hf:NAME[:CONFIG]``, read with
    ``datasets.load_dataset(NAME, CONFIG)``; ``path`` is then ``NAME``)."""

    path: Path
    kind: str
    name: str  # as given, for messages
    split: str | None = None  # "train" or "valid" when the caller fixes it (the embedded corpus)
    config: str | None = None  # a hub dataset's configuration

    def files(self) -> list[Path]:
        """The files whose contents make this source (for the cache key); none for the hub."""
        if self.kind == "hub":
            return []
        if self.path.is_dir():
            return sorted(p for p in self.path.rglob("*") if p.is_file())
        return [self.path]

    def size(self) -> int:
        if self.kind == "hub":
            return sum(d.data.nbytes for _, d, _ in _splits(self, _load_hub(str(self.path), self.config)))
        return sum(p.stat().st_size for p in self.files())

    def identity(self) -> list:
        """What the cache key hashes besides the files: a hub dataset's name, configuration and
        the fingerprints of its loaded splits (new when the hub's files change)."""
        if self.kind != "hub":
            return []
        loaded = _load_hub(str(self.path), self.config)
        return [self.name, [(name, d._fingerprint) for name, d, _ in _splits(self, loaded)]]


def source(entry: str) -> Source:
    """The kind of a ``--data`` entry, from its name (a directory: a saved dataset; ``hf:``: the hub)."""
    if entry.startswith(HUB):
        name, _, config = entry[len(HUB) :].partition(":")
        if not name:
            raise DataError(f"--data {entry!r}: name a dataset after hf: (hf:NAME or hf:NAME:CONFIG)")
        return Source(Path(name), "hub", entry, config=config or None)
    path = Path(entry).expanduser()
    if path.is_dir():
        if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            raise DataError(f"--data: {entry} is a directory but not a dataset saved with `datasets` (no dataset_info.json, dataset_dict.json or state.json)")  # fmt: skip
        return Source(path, "dataset", entry)
    if not path.is_file():
        raise DataError(f"--data: {entry} is not a file")
    suffix = path.suffix.lower()
    kind = "jsonl" if suffix in JSON_LINES else "parquet" if suffix in PARQUET else "text"
    return Source(path, kind, entry)


Record = tuple[dict[str, Any], str, "str | None"]


def records(src: Source, progress=None) -> Iterator[Record]:
    """Every record of ``src`` with where it is (``file:line``, ``file row N``) and its split
    when the source fixes one (a saved dataset's ``validation`` split), else ``None``."""
    if src.kind == "text":
        data = src.path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{src.name}: not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r})") from None
        if progress:
            progress(len(data))
        yield {"text": text}, src.name, src.split
    elif src.kind == "jsonl":
        yield from _json_lines(src, progress)
    elif src.kind == "parquet":
        yield from _parquet(src, progress)
    else:
        yield from _dataset(src, progress)


def _json_lines(src: Source, progress) -> Iterator[Record]:
    with open(src.path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if progress:
                progress(len(raw))
            line = raw.strip()
            if not line:
                continue
            where = f"{src.name}:{number}"
            try:
                value = json.loads(line)
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            except json.JSONDecodeError as e:
                hint = " (a JSON array? --data reads JSON lines: one object per line)" if number == 1 and line[:1] == b"[" else ""
                raise DataError(f"{where}: not valid JSON: {e.msg} (column {e.colno}){hint}") from None
            if not isinstance(value, dict):
                raise DataError(f"{where}: expected a JSON object per line, got {type(value).__name__}")
            yield value, where, None


def _parquet(src: Source, progress) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"--data {src.name}: reading Parquet needs pyarrow: pip install 'zoo[data]' (or pip install pyarrow)") from None
    try:
        f = pq.ParquetFile(src.path)
    except Exception as e:  # noqa: BLE001 (pyarrow's ArrowInvalid and friends)
        raise DataError(f"{src.name}: cannot be read as Parquet ({e})") from None
    row, total = 0, max(1, f.metadata.num_rows)
    size = src.path.stat().st_size
    for batch in f.iter_batches(batch_size=1024):
        for value in batch.to_pylist():
            yield value, f"{src.name} row {row}", None
            row += 1
        if progress:
            progress(size * batch.num_rows // total)


VALID_SPLITS = ("validation", "valid", "test")


def _datasets_module(src: Source):
    try:
        import datasets
    except ImportError:
        what = "a Hugging Face hub dataset" if src.kind == "hub" else "a Hugging Face dataset directory"
        raise DataError(
            f"--data {src.name} is {what}; reading it needs the `datasets` package: "
            "pip install 'zoo[data]' (or pip install datasets)"
        ) from None
    return datasets


@functools.cache
def _load_hub(name: str, config: str | None):
    """``datasets.load_dataset(name, config)``, once per process (it downloads into the
    Hugging Face cache, ``HF_DATASETS_CACHE``, and reads from there after)."""
    src = Source(Path(name), "hub", HUB + name + (f":{config}" if config else ""), config=config)
    datasets = _datasets_module(src)
    try:
        return datasets.load_dataset(name, config)
    except Exception as e:  # noqa: BLE001 (ConnectionError, DatasetNotFoundError, ValueError, ...)
        raise DataError(f"--data {src.name}: datasets.load_dataset({name!r}{f', {config!r}' if config else ''}) failed: "
                        f"{type(e).__name__}: {e} (offline? HF_HUB_OFFLINE=1 reads what the hub cache holds)") from None  # fmt: skip


def _splits(src: Source, loaded) -> list:
    """``(name, dataset, split)`` of a loaded dataset or dataset dict: its ``train`` split, and
    its validation split (``validation``/``valid``/``test``) held out where it has one."""
    datasets = _datasets_module(src)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{src.name}: a dataset dict without a 'train' split (splits: {', '.join(loaded)})")
        held = next((s for s in VALID_SPLITS if s in loaded), None)
        return [("train", loaded["train"], "train")] + ([(held, loaded[held], "valid")] if held else [])
    return [(None, loaded, None)]


def _dataset(src: Source, progress) -> Iterator[Record]:
    if src.kind == "hub":
        loaded = _load_hub(str(src.path), src.config)
    else:
        datasets = _datasets_module(src)
        try:
            loaded = datasets.load_from_disk(str(src.path))
        except Exception as e:  # noqa: BLE001 (datasets raises FileNotFoundError, ValueError, ...)
            raise DataError(f"{src.name}: cannot be loaded with datasets.load_from_disk ({e})") from None
    parts = _splits(src, loaded)
    size = max(1, src.size())
    total = max(1, sum(len(d) for _, d, _ in parts))
    for name, ds, split in parts:
        label = f"{src.name}[{name}]" if name else src.name
        for row, value in enumerate(ds):
            yield dict(value), f"{label} row {row}", split
            if progress and row % 1024 == 1023:
                progress(size * 1024 // total)


# --- records as documents --------------------------------------------------------------------


def record_format(record: dict[str, Any], text_field: str) -> str:
    """What an ``auto`` record is: chat (``messages``), completion (``prompt`` and
    ``completion``) or text."""
    if "messages" in record and text_field not in record:
        return "chat"
    if "prompt" in record and "completion" in record and text_field not in record:
        return "completion"
    return "text"


def text_of(record: dict[str, Any], where: str, field: str) -> str:
    if field not in record:
        fields = ", ".join(map(repr, record)) or "none"
        raise DataError(f"{where}: no field {field!r} (fields: {fields}); choose the text's field with --text-field")
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}, not a string")
    return value


def messages_of(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    """The conversation of a chat record, checked: roles system/user/assistant, string contents,
    at least one assistant message."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: messages[{i}] must be an object with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{i}] has unknown role {m['role']!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: messages[{i}].content is {type(m['content']).__name__}, not a string")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message, so nothing to learn from this conversation")
    return out
