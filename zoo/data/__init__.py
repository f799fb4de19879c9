"""Training data: the embedded corpus, text, JSON lines, Parquet and saved Hugging Face datasets,
tokenized with a checkpoint's tokenizer (or as bytes), packed into rows, and batches that depend
only on (seed, step). The reference is docs/data.md.

Two kinds of data come out of :func:`load_data`, each with ``batch(seed, step, batch_size,
seq_len, split=)``:

- :class:`TokenData`, a token stream (byte-level text with no tokenizer, the embedded corpus,
  ``.npy`` token files): random windows, a plain ``int32 [B, S]`` array;
- :class:`PackedData`, documents packed into rows: a dict of ``input_ids``, ``segment_ids``,
  ``positions`` (int32 [B, S]) and ``loss_mask`` (bool [B, S]).
"""

from __future__ import annotations

from pathlib import Path

from zoo.data.corpus import Share, default_cache_dir, load_documents
from zoo.data.packing import Documents, PackedData, PackedRows, Plan, pack_documents, plan_rows, valid_by_hash
from zoo.data.sources import FORMATS, Source, source
from zoo.data.stream import (
    TokenData,
    _split_by_name,
    check_token_range,
    stdlib_corpus,
    stdlib_files,
    text_files,
    token_file,
)
from zoo.data.tokenizer import (
    ByteTokenizer,
    ChatEncoder,
    DataError,
    HFTokenizer,
    TextStream,
    check_vocabulary,
    copy_tokenizer_files,
    load_tokenizer,
)

__all__ = [
    "FORMATS", "ByteTokenizer", "ChatEncoder", "DataError", "Documents", "HFTokenizer", "PackedData", "PackedRows",
    "Plan", "Source", "TextStream", "TokenData", "check_token_range", "check_vocabulary", "copy_tokenizer_files", "default_cache_dir", "load_data",
    "Share", "load_documents", "load_tokenizer", "pack_documents", "plan_rows", "source", "stdlib_corpus", "stdlib_files",
    "text_files", "token_file", "valid_by_hash",
]  # fmt: skip


def _stdlib_sources(valid_fraction: float) -> list[Source]:
    """The embedded corpus's files as documents, split by name as the byte stream splits them."""
    root, files = stdlib_files()
    names = [str(p.relative_to(root)) for p in files]
    _, valid = _split_by_name(names, valid_fraction)
    held = set(valid)
    return [Source(p, "text", f"stdlib:{n}", "valid" if i in held else "train") for i, (p, n) in enumerate(zip(files, names))]


def load_data(
    spec: str | None,
    vocab_size: int,
    *,
    tokenizer: HFTokenizer | ByteTokenizer | None = None,
    text_field: str = "text",
    data_format: str = "auto",
    valid_fraction: float = 0.05,
    cache_dir: str | Path | None = None,
    packed: bool | None = None,
    method: str = "best_fit",
    progress: bool = True,
    share: Share | None = None,
) -> TokenData | PackedData:
    """The data of a ``--data`` spec for a model of ``vocab_size`` tokens.

    ``spec``: ``None``/``"stdlib"`` (the embedded corpus), a ``.npy`` of token ids, or a
    comma-separated list of text files, JSON lines (``.jsonl``/``.json``), Parquet files and
    directories written by ``datasets.save_to_disk``. ``tokenizer``: the checkpoint's
    (:func:`load_tokenizer`); ``None`` or bytes keeps byte-level text files and the embedded
    corpus as token streams (:class:`TokenData`, as before) unless ``packed``. Everything else
    is tokenized once into the cache (``cache_dir``, default ``~/.cache/zoo/data``) and packed
    (:class:`PackedData`). ``data_format``: ``auto`` (each source's first record decides:
    ``messages`` chat, ``prompt``+``completion`` pairs, else the ``text_field`` text), ``text``,
    ``chat`` or ``completion``. ``share``: this process's share of the tokenizing when many
    processes load the same data (:class:`Share`).
    """
    if data_format not in FORMATS:
        raise DataError(f"data format must be one of {', '.join(FORMATS)}, got {data_format!r}")
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    byte_level = isinstance(tok, ByteTokenizer)
    if spec is not None and spec.endswith(".npy"):
        return token_file(spec, vocab_size)
    if spec in (None, "", "stdlib"):
        if byte_level and not packed:
            return _byte_range_checked(stdlib_corpus(valid_fraction=valid_fraction), vocab_size)
        sources, name = _stdlib_sources(valid_fraction), "stdlib"
    else:
        entries = [e for e in spec.split(",") if e]
        if not entries:
            raise DataError(f"--data {spec!r} names no file")
        sources, name = [source(e) for e in entries], spec
        if byte_level and not packed and data_format in ("auto", "text") and all(s.kind == "text" for s in sources):
            return _byte_range_checked(text_files([s.path for s in sources], valid_fraction), vocab_size)
    if not byte_level:
        check_vocabulary(tok, vocab_size)
    docs, meta = load_documents(sources, tok, text_field=text_field, data_format=data_format,
                                valid_fraction=valid_fraction, cache_dir=cache_dir, progress=progress,
                                share=share)  # fmt: skip
    if byte_level and vocab_size < 256:
        check_token_range(docs.tokens, vocab_size, name)
    return PackedData(docs, tok.vocab_size, name, tok.describe(), method, meta=meta)


def _byte_range_checked(data: TokenData, vocab_size: int) -> TokenData:
    if vocab_size < data.vocab_size:  # byte tokens need a vocabulary of 256
        for split in (data.train, data.valid):
            check_token_range(split, vocab_size, data.source)
    return data
