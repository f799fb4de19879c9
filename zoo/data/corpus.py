"""Tokenize a corpus once into a cache directory; later runs memory-map it at once.

The cache key is a hash of the tokenizer's files, every data file's path and contents (its
SHA-256, remembered in ``file-hashes.json`` against the file's size, times and inode, so an
unchanged file is not read again), and the options that change the tokens (format, text field,
held-out fraction): any edit to a data file or the tokenizer tokenizes again. A cache entry is
written under a temporary name and renamed when complete: an interrupted run leaves none. It
records each of its files' size and CRC-32, checked whenever it is opened: a damaged entry is
named, removed and tokenized again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zoo.data.packing import Documents, valid_by_hash
from zoo.data.sources import Source, messages_of, record_format, records, text_of
from zoo.data.tokenizer import ByteTokenizer, ChatEncoder, DataError, HFTokenizer

CACHE_VERSION = 2  # 2: entries keyed on contents, with their files' checksums
BATCH = 512  # records tokenized per call (the tokenizers library runs a batch on every core)


def default_cache_dir() -> Path:
    """``$ZOO_CACHE_DIR`` or ``~/.cache/zoo``, plus ``data``."""
    return Path(os.environ.get("ZOO_CACHE_DIR") or Path.home() / ".cache" / "zoo") / "data"


def cache_key(sources: Sequence[Source], tokenizer: HFTokenizer | ByteTokenizer, options: dict[str, Any],
              root: Path | None = None) -> str:  # fmt: skip
    """The entry name of these sources tokenized so: a hash of the data files' paths and contents
    (see :class:`ContentHashes`; ``root``: the cache directory, which remembers them), the
    tokenizer's fingerprint and ``options``."""
    hashes = ContentHashes(root)
    files = []
    for src in sources:
        for f in src.files():
            files.append([str(f.resolve()), hashes.of(f), src.kind, src.split])
        if src.kind == "hub":
            files.append(src.identity())
    hashes.save()
    blob = json.dumps({"version": CACHE_VERSION, "tokenizer": tokenizer.fingerprint, "files": files, **options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            yield chunk


class ContentHashes:
    """Files' SHA-256, remembered in ``root/file-hashes.json`` against each file's size,
    modification and change times and inode: the change time moves on every write (``touch``
    cannot set it back), so a file whose four are the same is unchanged and not read again.
    ``root`` None, or a cache directory that cannot be written: nothing remembered."""

    def __init__(self, root: Path | None):
        self.file = root / "file-hashes.json" if root is not None else None
        self.memo: dict[str, Any] = {}
        self.changed = False
        if self.file is not None and self.file.is_file():
            try:
                self.memo = json.loads(self.file.read_text())
            except (OSError, ValueError):
                self.memo = {}  # damaged: forgotten, every file hashed again

    def of(self, path: Path) -> str:
        st = path.stat()
        stamp, key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino], str(path.resolve())
        known = self.memo.get(key)
        if isinstance(known, list) and known[:4] == stamp:
            return str(known[4])
        digest = hashlib.sha256()
        for chunk in _chunks(path):
            digest.update(chunk)
        self.memo[key], self.changed = [*stamp, digest.hexdigest()], True
        return digest.hexdigest()

    def save(self) -> None:
        if self.file is None or not self.changed:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_name(f".{self.file.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
            tmp.write_text(json.dumps(self.memo))
            os.replace(tmp, self.file)
        except OSError:  # a read-only cache: hashed again next time
            pass


class _Progress:
    """``tokenizing NAME: 42% (1,234 documents, 5.6M tokens)`` on stderr, at most once a second
    (rewritten in place on a terminal)."""

    def __init__(self, total_bytes: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = max(1, total_bytes), label, enabled
        self.done, self.docs, self.tokens = 0, 0, 0
        self.start = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and now - self.last >= (1.0 if self.tty else 10.0):
            self.last = now
            self._print("\r" if self.tty else "", "" if self.tty else "\n")

    def _print(self, head: str, tail: str) -> None:
        pct = min(100.0, 100.0 * self.done / self.total)
        sys.stderr.write(f"{head}tokenizing {self.label}: {pct:.0f}% ({self.docs:,} documents, {self.tokens / 1e6:.2f}M tokens){tail}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.last != self.start:
            sys.stderr.write("\n")


class _Writer:
    """Appends documents to ``tokens.bin`` / ``mask.bin`` in a directory."""

    def __init__(self, directory: Path, dtype: np.dtype):
        self.dir, self.dtype = directory, dtype
        self.tokens = open(directory / "tokens.bin", "wb")  # noqa: SIM115 (closed by close())
        self.mask = open(directory / "mask.bin", "wb")  # noqa: SIM115
        self.lengths: list[int] = []
        self.nbytes: list[int] = []
        self.valid: list[bool] = []
        self.masked = False

    def add(self, ids: np.ndarray, mask: np.ndarray | None, nbytes: int, valid: bool) -> None:
        self.tokens.write(np.asarray(ids).astype(self.dtype).tobytes())
        self.mask.write((np.ones(len(ids), np.uint8) if mask is None else mask.astype(np.uint8)).tobytes())
        self.masked |= mask is not None
        self.lengths.append(len(ids))
        self.nbytes.append(nbytes)
        self.valid.append(valid)

    def close(self) -> None:
        self.tokens.close()
        self.mask.close()


def _encode_pending(pending: list, tokenizer, writer: _Writer, fraction: float, progress: _Progress) -> None:
    """Tokenize a batch of ``(format, payload, split)`` and append the documents."""
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    texts = [p for f, p, _ in pending if f == "text"]
    pairs = [p for f, p, _ in pending if f == "completion"]
    encoded_texts = iter(tokenizer.encode_batch(texts)) if texts else iter(())
    flat = [s for pair in pairs for s in pair]
    encoded_pairs = iter(tokenizer.encode_batch(flat)) if flat else iter(())
    keys, docs = [], []
    for fmt, payload, split in pending:
        if fmt == "text":
            body = next(encoded_texts)
            ids = np.concatenate([np.asarray(bos, np.int32), body, np.asarray(eos, np.int32)])
            docs.append((ids, None, len(payload.encode("utf-8")), split))
            keys.append(payload.encode("utf-8"))
        elif fmt == "completion":
            prompt, completion = next(encoded_pairs), next(encoded_pairs)
            ids = np.concatenate([np.asarray(bos, np.int32), prompt, completion, np.asarray(eos, np.int32)])
            mask = np.zeros(len(ids), bool)
            mask[len(bos) + len(prompt) :] = True  # the completion and the end of sequence
            docs.append((ids, mask, len(payload[1].encode("utf-8")), split))
            keys.append(json.dumps(payload).encode("utf-8"))
        else:
            ids, mask, nbytes, key = payload
            docs.append((ids, mask, nbytes, split))
            keys.append(key)
    held = valid_by_hash(keys, fraction)
    for (ids, mask, nbytes, split), h in zip(docs, held.tolist()):
        writer.add(ids, mask, nbytes, h if split is None else split == "valid")
        progress.docs += 1
        progress.tokens += len(ids)


def tokenize_to(
    directory: Path,
    sources: Sequence[Source],
    tokenizer: HFTokenizer | ByteTokenizer,
    *,
    text_field: str,
    data_format: str,
    valid_fraction: float,
    progress: bool,
    part: tuple[int, int] = (0, 1),
) -> dict[str, Any]:
    """Tokenize every record of ``sources`` into ``directory``; returns the metadata.

    ``part=(i, n)``: only records ``i, i+n, i+2n, ...`` (counting across all sources), every
    record still read and checked; :func:`merge_parts` puts ``n`` such parts back in order."""
    index, count = part
    dtype = np.dtype(np.uint8 if tokenizer.vocab_size <= 256 else np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32)
    writer = _Writer(directory, dtype)
    label = sources[0].name + (f" and {len(sources) - 1} more" if len(sources) > 1 else "")
    meter = _Progress(sum(s.size() for s in sources), label, progress)
    chat = None
    pending: list = []
    formats: dict[str, int] = {}
    number = -1
    try:
        for src in sources:
            fmt = None if data_format == "auto" else data_format
            for record, where, split in records(src, meter):
                if src.kind == "text":
                    this, field = "text", "text"
                else:
                    this, field = fmt or record_format(record, text_field), text_field
                    fmt = this
                number += 1
                mine = number % count == index  # every record is read and checked; a part tokenizes its own
                if this == "text":
                    item = ("text", text_of(record, where, field), split)
                elif this == "completion":
                    item = ("completion", (text_of(record, where, "prompt"), text_of(record, where, "completion")), split)
                else:
                    messages = messages_of(record, where)
                    if mine:
                        try:
                            chat = chat or ChatEncoder(tokenizer)
                            ids, mask, nbytes = chat.encode(messages)
                        except DataError as e:
                            raise DataError(f"{where}: {e}") from None
                        key = json.dumps(messages, sort_keys=True).encode("utf-8")
                        item = ("chat", (ids, mask, nbytes, key), split)
                if not mine:
                    continue
                pending.append(item)
                formats[this] = formats.get(this, 0) + 1
                if len(pending) >= BATCH:
                    _encode_pending(pending, tokenizer, writer, valid_fraction, meter)
                    pending = []
        if pending:
            _encode_pending(pending, tokenizer, writer, valid_fraction, meter)
    finally:
        writer.close()
        meter.close()
    names = ", ".join(s.name for s in sources)
    if count == 1:  # a part may hold no document; merge_parts checks the whole
        _check_documents(writer.lengths, names)
    return _finish(directory, writer.dtype, writer.lengths, writer.nbytes, writer.valid, writer.masked, formats,
                   tokenizer.describe(), names, time.perf_counter() - meter.start)  # fmt: skip


def _check_documents(lengths: Sequence[int], names: str) -> None:
    if not len(lengths):
        raise DataError(f"--data {names}: no records (an empty dataset)")
    if not any(n >= 2 for n in lengths):
        raise DataError(f"--data {names}: {len(lengths)} records but no document of 2 or more tokens: nothing to predict")


def _finish(directory: Path, dtype: np.dtype, lengths, nbytes, valid, masked: bool, formats: dict[str, int],
            tokenizer: str, sources: str, seconds: float) -> dict[str, Any]:  # fmt: skip
    """Write the index files and ``meta.json`` beside ``tokens.bin`` (and ``mask.bin``)."""
    lengths = np.asarray(lengths, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    np.save(directory / "offsets.npy", offsets)
    np.save(directory / "nbytes.npy", np.asarray(nbytes, np.int64))
    np.save(directory / "valid.npy", np.asarray(valid, bool))
    if not masked:
        (directory / "mask.bin").unlink()
    meta = {
        "version": CACHE_VERSION, "dtype": dtype.name, "documents": len(lengths), "tokens": int(offsets[-1]),
        "masked": masked, "formats": formats, "tokenizer": tokenizer, "sources": sources, "seconds": round(seconds, 3),
        "checksums": {name: [(directory / name).stat().st_size, _crc32(directory / name)]
                      for name in ENTRY_FILES if (directory / name).is_file()},
    }  # fmt: skip
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def merge_parts(directory: Path, parts: Sequence[Path]) -> dict[str, Any]:
    """Write into ``directory`` the entry that tokenizing everything at once writes, from the
    ``n`` entries ``tokenize_to(..., part=(i, n))`` wrote: document ``d`` is document ``d // n``
    of part ``d % n``. Byte for byte the same files."""
    opened = [open_documents(p) for p in parts]
    metas = [m for _, m in opened]
    count = len(parts)
    total = sum(len(d) for d, _ in opened)
    dtype = np.dtype(metas[0]["dtype"])
    masked = any(m["masked"] for m in metas)
    order = [(d % count, d // count) for d in range(total)]
    with open(directory / "tokens.bin", "wb") as tokens, open(directory / "mask.bin", "wb") as mask:
        for i, j in order:
            docs = opened[i][0]
            a, b = int(docs.offsets[j]), int(docs.offsets[j + 1])
            tokens.write(np.asarray(docs.tokens[a:b]).tobytes())
            m = np.ones(b - a, np.uint8) if docs.loss_mask is None else np.asarray(docs.loss_mask[a:b]).astype(np.uint8)
            mask.write(m.tobytes())
    lengths = [int(opened[i][0].offsets[j + 1] - opened[i][0].offsets[j]) for i, j in order]
    nbytes = [int(opened[i][0].nbytes[j]) for i, j in order]
    valid = [bool(opened[i][0].valid[j]) for i, j in order]
    formats: dict[str, int] = {}
    for m in metas:
        for k, v in m["formats"].items():
            formats[k] = formats.get(k, 0) + v
    names = metas[0]["sources"]
    _check_documents(lengths, names)
    return _finish(directory, dtype, lengths, nbytes, valid, masked, formats, metas[0]["tokenizer"], names,
                   max(m["seconds"] for m in metas))  # fmt: skip


# A cache entry's data files (mask.bin only where a loss mask is), each checksummed in meta.json.
ENTRY_FILES = ("tokens.bin", "mask.bin", "offsets.npy", "nbytes.npy", "valid.npy")


def _crc32(path: Path) -> int:
    crc = 0
    for chunk in _chunks(path):
        crc = zlib.crc32(chunk, crc)
    return crc


def entry_damage(entry: Path) -> str | None:
    """What is wrong with a cache entry (its meta.json, a file missing, of another size than
    written, or not matching its checksum), or None: it is as written."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        sums = {name: (int(size), int(crc)) for name, (size, crc) in meta["checksums"].items()}
        dtype, tokens = np.dtype(meta["dtype"]), int(meta["tokens"])
        if "tokens.bin" not in sums:
            raise ValueError("no checksum of tokens.bin")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its meta.json does not read ({type(e).__name__}: {e})"
    if dtype.kind != "u":
        return f"its meta.json says the tokens are {dtype}, not an unsigned integer type"
    if sums["tokens.bin"][0] != tokens * dtype.itemsize:
        return f"its meta.json says {tokens} tokens of {dtype}, not the {sums['tokens.bin'][0]} bytes of tokens.bin"
    for name, (size, crc) in sums.items():
        path = entry / name
        try:
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, not the {size} written"
            if _crc32(path) != crc:
                return f"{name} does not match the checksum written with it"
        except FileNotFoundError:  # (or another process has just moved the damaged entry aside)
            return f"{name} is missing"
    return None


def _discard(entry: Path, why: str) -> None:
    """Remove a damaged or incomplete cache entry (renamed first: another process may be at it too)."""
    aside = entry.parent / f".{entry.name}.damaged-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(entry, aside)
    except FileNotFoundError:  # another process moved it first
        return
    print(f"data cache: {entry} {why}; removed it, tokenizing again", file=sys.stderr, flush=True)
    shutil.rmtree(aside, ignore_errors=True)


def open_documents(directory: Path) -> tuple[Documents, dict[str, Any]]:
    """A cache entry's documents, memory-mapped."""
    meta = json.loads((directory / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    n = meta["tokens"]
    tokens = np.memmap(directory / "tokens.bin", dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    mask = None
    if meta["masked"]:
        mask = np.memmap(directory / "mask.bin", dtype=np.bool_, mode="r", shape=(n,)) if n else np.zeros(0, bool)
    docs = Documents(
        tokens, np.load(directory / "offsets.npy"), mask, np.load(directory / "nbytes.npy"), np.load(directory / "valid.npy")
    )
    return docs, meta


def ensure_both_splits(docs: Documents) -> Documents:
    """At least one held-out and one training document: with none held out the last document
    is; a single document is cut at 95% of its tokens (the tail validates)."""
    valid = np.array(docs.valid, dtype=bool)
    usable = docs.lengths() >= 2
    if np.any(valid & usable) and np.any(~valid & usable):
        return docs
    idx = np.flatnonzero(usable)
    if len(idx) >= 2:
        if not np.any(valid & usable):
            valid[idx[-1]] = True
        else:
            valid[idx[0]] = False
        return Documents(docs.tokens, docs.offsets, docs.loss_mask, docs.nbytes, valid)
    d = int(idx[0])  # the only document that can be predicted: cut it in two, drop the rest
    a, b = int(docs.offsets[d]), int(docs.offsets[d + 1])
    if b - a < 4:
        raise DataError(f"one document of {b - a} tokens: too little data for a training and a validation split")
    cut = min(max(2, int((b - a) * 0.95)), b - a - 2)
    mask = None if docs.loss_mask is None else np.asarray(docs.loss_mask[a:b])
    nb = int(docs.nbytes[d]) if docs.nbytes is not None else b - a
    share = round(nb * cut / (b - a))
    offsets = np.array([0, cut, b - a], np.int64)
    return Documents(np.asarray(docs.tokens[a:b]), offsets, mask, np.array([share, nb - share], np.int64), np.array([False, True]))


@dataclass(frozen=True)
class Share:
    """This process's share of the tokenizing when ``count`` processes load the same data: it
    tokenizes records ``index, index+count, ...``; ``barrier(name)`` returns once every process
    has called it with ``name`` (``multihost_utils.sync_global_devices`` under JAX)."""

    index: int
    count: int
    barrier: Callable[[str], None]


def _complete(entry: Path) -> bool:
    return (entry / "meta.json").is_file()


def _write_entry(entry: Path, write: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """``write(tmp)`` into a temporary directory renamed to ``entry`` when complete: an
    interrupted run leaves no entry behind."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    if entry.exists() and not _complete(entry):  # left incomplete (its meta.json deleted): it would block the rename
        _discard(entry, "is incomplete (no meta.json)")
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # one per writer, threads too
    tmp.mkdir()  # with the umask's permissions (mkdtemp's 0700 would keep a shared cache from others)
    try:
        meta = write(tmp)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process finished the same entry first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def load_documents(
    sources: Sequence[Source],
    tokenizer: HFTokenizer | ByteTokenizer,
    *,
    text_field: str = "text",
    data_format: str = "auto",
    valid_fraction: float = 0.05,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    share: Share | None = None,
) -> tuple[Documents, dict[str, Any]]:
    """The documents of ``sources`` from the cache, tokenizing them first if needed.

    ``share``: many processes split the tokenizing: each writes its records into a part entry,
    process 0 merges the parts into the entry one process would have written (the same bytes),
    and all read that. Where a process's cache directory is its own (not shared with process
    0), it tokenizes everything itself after the others."""
    options = {"text_field": text_field, "format": data_format, "valid_fraction": valid_fraction}
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / cache_key(sources, tokenizer, options, root)
    if _complete(final) and (why := entry_damage(final)) is not None:
        _discard(final, f"is damaged: {why}")

    def tokenize(part: tuple[int, int]) -> Callable[[Path], dict[str, Any]]:
        return lambda tmp: tokenize_to(tmp, sources, tokenizer, text_field=text_field, data_format=data_format,
                                       valid_fraction=valid_fraction, progress=progress, part=part)  # fmt: skip

    def report(meta: dict[str, Any], what: str, where: Path) -> None:
        if progress:
            print(f"{what} {meta['documents']:,} documents ({meta['tokens']:,} tokens) in {meta['seconds']:.1f} s "
                  f"into {where}", file=sys.stderr, flush=True)  # fmt: skip

    if share is not None and share.count > 1:
        i, n = share.index, share.count
        parts = [root / f".{final.name}.part-{k}-of-{n}" for k in range(n)]
        # Every process passes both barriers whatever its cache holds or its data says, so none
        # waits forever: bad data found in one part or in the merge leaves the entry missing, and
        # every process then meets the same error tokenizing everything below.
        if not _complete(final) and not _complete(parts[i]):
            try:
                report(_write_entry(parts[i], tokenize((i, n))), f"tokenized part {i + 1} of {n}:", parts[i])
            except DataError:
                pass
        share.barrier("zoo: data parts tokenized")
        if i == 0 and not _complete(final) and all(_complete(p) for p in parts):
            try:
                report(_write_entry(final, lambda tmp: merge_parts(tmp, parts)), f"merged {n} parts:", final)
            except DataError:
                pass
        share.barrier("zoo: data parts merged")
        shutil.rmtree(parts[i], ignore_errors=True)
    if not _complete(final):
        report(_write_entry(final, tokenize((0, 1))), "tokenized", final)
    docs, meta = open_documents(final)
    meta["cache"] = str(final)
    return ensure_both_splits(docs), meta
