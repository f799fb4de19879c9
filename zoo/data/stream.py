"""Token streams: byte-level text and ``.npy`` token files, batches of random windows that depend
only on (seed, step).

The embedded default needs no download: byte-level tokens (vocabulary 256) of the Python
standard library's own source files, which every machine that runs zoo has.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jaxtyping import Int, UInt8

from zoo.errors import ConfigError


@dataclass(frozen=True)
class TokenData:
    """Train and validation token streams (1-D arrays, memory-mapped where possible)."""

    train: np.ndarray
    valid: np.ndarray
    vocab_size: int
    source: str

    def batch(
        self, seed: int, step: int, batch_size: int, seq_len: int, *, split: str = "train",
        rows: Int[np.ndarray, " R"] | None = None,
    ) -> Int[np.ndarray, "R S"]:  # fmt: skip
        """``batch_size`` windows of ``seq_len`` tokens at offsets drawn from (seed, step) alone,
        so a resumed run sees exactly the batches an uninterrupted one would. ``rows``: only
        these rows of it (a process's share), read alone."""
        tokens = self._split(split, seq_len)
        rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
        starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
        starts = starts if rows is None else starts[rows]
        return np.stack([np.asarray(tokens[s : s + seq_len], dtype=np.int32) for s in starts])

    def check(self, seq_len: int) -> None:
        """Refuse (``ConfigError``) splits too short for one window of ``seq_len`` + 1 tokens:
        before a run starts, not at its first batch."""
        for split in ("train", "valid"):
            self._split(split, seq_len)

    def _split(self, split: str, seq_len: int) -> np.ndarray:
        """A split's tokens, refused (``ConfigError``) if too short for a window of ``seq_len`` + 1."""
        tokens = self.train if split == "train" else self.valid
        if len(tokens) <= seq_len:
            raise ConfigError(f"{self.source}: the {split} split has {len(tokens)} tokens, fewer than seq_len + 1 = "
                              f"{seq_len + 1} (--seq-len {seq_len}): more data or a shorter --seq-len")  # fmt: skip
        return tokens

    def num_tokens(self, split: str = "train") -> int:
        """Tokens in ``split`` ("train" or "valid")."""
        return len(self.train if split == "train" else self.valid)


def _split_by_name(names: list[str], valid_fraction: float) -> tuple[list[int], list[int]]:
    """Validation = the files whose name hashes below ``valid_fraction`` (stable across runs)."""
    train, valid = [], []
    for i, name in enumerate(names):
        h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "little") / 2**32
        (valid if h < valid_fraction else train).append(i)
    if not valid:
        valid.append(train.pop())
    return train, valid


def _concat(chunks: list[bytes]) -> UInt8[np.ndarray, " N"]:
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


def stdlib_files(max_bytes: int = 48 * 2**20) -> tuple[Path, list[Path]]:
    """The standard library's root and the ``.py`` files of the embedded corpus (sorted; no
    site-packages, no tests; the first ``max_bytes`` of them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )  # fmt: skip
    chosen, total = [], 0
    for p in files:
        chosen.append(p)
        total += p.stat().st_size
        if total >= max_bytes:
            break
    if not chosen:
        raise ConfigError(f"no Python source files found under {root}")
    return root, chosen


def stdlib_corpus(max_bytes: int = 48 * 2**20, valid_fraction: float = 0.05) -> TokenData:
    """Bytes of the standard library's ``.py`` files (sorted; no site-packages, no tests)."""
    root, files = stdlib_files(max_bytes)
    chunks = [p.read_bytes() for p in files]
    names = [str(p.relative_to(root)) for p in files]
    train, valid = _split_by_name(names, valid_fraction)
    return TokenData(_concat([chunks[i] for i in train]), _concat([chunks[i] for i in valid]), 256, f"stdlib:{root}")


def text_files(paths: list[str | Path], valid_fraction: float = 0.05) -> TokenData:
    """Byte-level tokens of a user's text files (split by file; one file is split 95/5)."""
    chunks, names = [], []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ConfigError(f"--data: {path} is not a file")
        chunks.append(path.read_bytes())
        names.append(str(path))
    if len(chunks) == 1:
        data = _concat(chunks)
        cut = int(len(data) * (1 - valid_fraction))
        return TokenData(data[:cut], data[cut:], 256, names[0])
    train, valid = _split_by_name(names, valid_fraction)
    return TokenData(_concat([chunks[i] for i in train]), _concat([chunks[i] for i in valid]), 256, ",".join(names))


def check_token_range(tokens: np.ndarray, vocab_size: int, source: str) -> None:
    """Every id in ``0 .. vocab_size - 1``, else a :class:`ConfigError` naming the source, the
    first offending id and its position (in one pass; ids wider than int32 included)."""
    if len(tokens) == 0:
        raise ConfigError(f"{source}: no tokens")
    low, high = int(np.min(tokens)), int(np.max(tokens))
    if low >= 0 and high < vocab_size:
        return
    bad = low if low < 0 else high
    where = int(np.argmax(tokens == np.asarray(bad).astype(tokens.dtype)))
    raise ConfigError(
        f"{source}: token id {bad} at position {where} is outside the model's vocabulary 0..{vocab_size - 1}"
    )


def token_file(path: str | Path, vocab_size: int, valid_fraction: float = 0.01) -> TokenData:
    """A pre-tokenized 1-D ``.npy`` of token ids, memory-mapped; the last ``valid_fraction``
    validates. Every id is checked against ``vocab_size`` first (an id past the vocabulary
    would read garbage inside ``jit``; a uint64 id would wrap when batches are cast to int32)."""
    path = Path(path)
    try:
        tokens = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"--data: cannot read {path} as a .npy token array ({e})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"--data: {path} must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
    check_token_range(tokens, vocab_size, str(path))
    cut = int(len(tokens) * (1 - valid_fraction))
    return TokenData(tokens[:cut], tokens[cut:], vocab_size, str(path))
