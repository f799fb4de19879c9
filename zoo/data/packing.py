"""Packing documents into rows of ``seq_len`` tokens, and batches of packed rows that depend only
on (seed, step).

A row holds whole documents (segments 1, 2, ...; 0 is padding) whose positions restart at 0;
the loss counts a prediction only inside one segment (``zoo.loss.next_token_targets``), so a
document never sees or predicts its neighbours. A document longer than a row is cut into pieces
of ``seq_len`` tokens that overlap by one token: every token of the document but its first is a
target exactly once (a piece's first token is context only, its ``loss_mask`` is off), so the
summed loss over all rows is the document's whole loss and bits per byte are exact.

Placement is best-fit decreasing by default (longest piece first, into the fullest row it fits,
found in O(1) per piece with a bit mask over the rows' free space); ``"greedy"`` fills rows in
document order, starting a new row when the next piece does not fit.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from jaxtyping import Bool, Int, Integer

from zoo.errors import ConfigError

METHODS = ("best_fit", "greedy")


@dataclass(frozen=True)
class Documents:
    """Token sequences stored end to end: document ``d`` is ``tokens[offsets[d]:offsets[d+1]]``.

    ``loss_mask`` (same length as ``tokens``, or ``None`` for all true): which tokens are
    targets. ``nbytes[d]``: UTF-8 bytes of the text whose tokens are targets (the document's
    text; the assistant turns of a chat) for bits per byte. ``valid[d]``: held out.
    """

    tokens: np.ndarray
    offsets: Int[np.ndarray, " D1"]
    loss_mask: np.ndarray | None = None
    nbytes: Int[np.ndarray, " D"] | None = None
    valid: Bool[np.ndarray, " D"] | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> Int[np.ndarray, " D"]:
        return np.diff(self.offsets)

    def split(self, name: str) -> Int[np.ndarray, " K"]:
        """Indices of the documents of ``name``: "train", "valid" or "all"."""
        n = len(self)
        if name == "all":
            return np.arange(n, dtype=np.int64)
        if name not in ("train", "valid"):
            raise ConfigError(f"split must be 'train', 'valid' or 'all', got {name!r}")
        held = self.valid if self.valid is not None else np.zeros(n, bool)
        return np.flatnonzero(held if name == "valid" else ~held).astype(np.int64)

    @staticmethod
    def from_sequences(
        docs: Sequence[Integer[np.ndarray, " _"]], loss_masks: Sequence[Bool[np.ndarray, " _"]] | None = None
    ) -> Documents:
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]) if len(docs) else np.zeros(0, np.int64)
        mask = None
        if loss_masks is not None:
            if len(loss_masks) != len(docs):
                raise ConfigError(f"{len(loss_masks)} loss masks for {len(docs)} documents")
            for i, (d, m) in enumerate(zip(docs, loss_masks)):
                if len(m) != len(d):
                    raise ConfigError(f"document {i}: loss mask of {len(m)} entries for {len(d)} tokens")
            mask = np.concatenate([np.asarray(m, dtype=bool) for m in loss_masks]) if len(docs) else np.zeros(0, bool)
        return Documents(tokens, offsets, mask)


@dataclass(frozen=True)
class Plan:
    """Where every piece goes: row ``r`` holds pieces ``row_ptr[r]:row_ptr[r+1]``; piece ``p`` is
    tokens ``start[p] : start[p] + length[p]`` of document ``doc[p]``."""

    doc: Int[np.ndarray, " P"]
    start: Int[np.ndarray, " P"]
    length: Int[np.ndarray, " P"]
    row_ptr: Int[np.ndarray, " R1"]
    seq_len: int

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def padding_fraction(self) -> float:
        """Padding tokens over all tokens of the rows."""
        cells = self.num_rows * self.seq_len
        return 1.0 - float(np.sum(self.length)) / cells if cells else 0.0


def _pieces(lengths: Int[np.ndarray, " D"], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every document into pieces of at most ``seq_len`` tokens overlapping by one token:
    piece j starts at j·(seq_len−1). Empty documents have none."""
    lengths = lengths.astype(np.int64)
    count = np.where(lengths > seq_len, -(-(lengths - 1) // (seq_len - 1)), (lengths > 0).astype(np.int64))
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), count)
    first = np.concatenate([[0], np.cumsum(count)[:-1]]) if len(count) else np.zeros(0, np.int64)
    j = np.arange(len(doc), dtype=np.int64) - np.repeat(first, count)
    start = j * (seq_len - 1)
    length = np.minimum(seq_len, lengths[doc] - start)
    return doc, start, length


def plan_rows(lengths: Int[np.ndarray, " D"], seq_len: int, method: str = "best_fit") -> Plan:
    """Place documents of these lengths into rows of ``seq_len`` tokens (see the module doc)."""
    if seq_len < 2:
        raise ConfigError(f"seq_len must be >= 2 to pack documents, got {seq_len}")
    if method not in METHODS:
        raise ConfigError(f"packing method must be one of {', '.join(METHODS)}, got {method!r}")
    doc, start, length = _pieces(np.asarray(lengths), seq_len)
    row = np.empty(len(doc), dtype=np.int64)
    if method == "greedy":
        r, free = -1, 0
        for p, n in enumerate(length.tolist()):
            if n > free:
                r, free = r + 1, seq_len
            row[p] = r
            free -= n
    else:
        full = length == seq_len  # a full piece is a row of its own
        row[full] = np.arange(int(np.sum(full)))
        nrows = int(np.sum(full))
        rest = np.flatnonzero(~full)
        order = rest[np.argsort(-length[rest], kind="stable")]
        buckets: list[list[int]] = [[] for _ in range(seq_len + 1)]  # free space -> rows with it
        avail = 0  # bit c set: some row has exactly c tokens free
        for p, n in zip(order.tolist(), length[order].tolist()):
            fits = avail >> n
            if fits:
                c = n + (fits & -fits).bit_length() - 1  # the least free space that still fits
                r = buckets[c].pop()
                if not buckets[c]:
                    avail ^= 1 << c
            else:
                r, c = nrows, seq_len
                nrows += 1
            row[p] = r
            left = c - n
            if left:
                if not buckets[left]:
                    avail |= 1 << left
                buckets[left].append(r)
    order = np.argsort(row, kind="stable")
    counts = np.bincount(row, minlength=int(row.max()) + 1 if len(row) else 0)
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Plan(doc[order], start[order], length[order], row_ptr, seq_len)


def materialize(
    docs: Documents, plan: Plan, rows: Int[np.ndarray, " B"], doc_ids: Int[np.ndarray, " K"] | None = None
) -> dict[str, np.ndarray]:
    """The packed rows ``rows`` of ``plan`` as ``{"input_ids", "segment_ids", "positions",
    "loss_mask"}`` ([len(rows), seq_len] each). ``doc_ids`` maps the plan's document numbers to
    ``docs`` (a split's documents)."""
    b, s = len(rows), plan.seq_len
    ids = np.zeros((b, s), np.int32)
    seg = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    mask = np.zeros((b, s), bool)
    ramp = np.arange(s, dtype=np.int32)
    for i, r in enumerate(np.asarray(rows).tolist()):
        at = 0
        for k, p in enumerate(range(int(plan.row_ptr[r]), int(plan.row_ptr[r + 1]))):
            d = int(plan.doc[p]) if doc_ids is None else int(doc_ids[plan.doc[p]])
            start, n = int(plan.start[p]), int(plan.length[p])
            a = int(docs.offsets[d]) + start
            ids[i, at : at + n] = docs.tokens[a : a + n]
            seg[i, at : at + n] = k + 1
            pos[i, at : at + n] = ramp[:n]
            mask[i, at : at + n] = True if docs.loss_mask is None else docs.loss_mask[a : a + n]
            if start > 0:  # a continuation's first token was the previous piece's last target
                mask[i, at] = False
            at += n
    return {"input_ids": ids, "segment_ids": seg, "positions": pos, "loss_mask": mask}


@dataclass(frozen=True)
class PackedRows:
    """Packed rows: ``tokens``, ``segment_ids`` (0 padding, 1, 2, ... per document in a row),
    ``positions`` (restarting at 0 per document) and ``loss_mask`` (targets), all [N, S]."""

    tokens: Int[np.ndarray, "N S"]
    segment_ids: Int[np.ndarray, "N S"]
    positions: Int[np.ndarray, "N S"]
    loss_mask: Bool[np.ndarray, "N S"]

    @property
    def padding_fraction(self) -> float:
        return float(np.mean(self.segment_ids == 0)) if self.segment_ids.size else 0.0


def pack_documents(
    docs: Sequence[Integer[np.ndarray, " _"]],
    seq_len: int,
    *,
    loss_masks: Sequence[Bool[np.ndarray, " _"]] | None = None,
    method: str = "best_fit",
) -> PackedRows:
    """Pack token sequences into rows of ``seq_len`` (see the module doc). ``loss_masks``: per
    document, which tokens are targets (default: all). Row order: full pieces first, then the
    rows best-fit filled (``"greedy"``: document order)."""
    d = Documents.from_sequences(docs, loss_masks)
    plan = plan_rows(d.lengths(), seq_len, method)
    out = materialize(d, plan, np.arange(plan.num_rows))
    return PackedRows(out["input_ids"], out["segment_ids"], out["positions"], out["loss_mask"])


def valid_by_hash(keys: Sequence[bytes], valid_fraction: float) -> Bool[np.ndarray, " D"]:
    """Held-out documents: those whose key (their content) hashes below ``valid_fraction``; stable
    across runs and orderings, and duplicates land in the same split."""
    return np.array(
        [int.from_bytes(hashlib.sha1(k).digest()[:4], "little") / 2**32 < valid_fraction for k in keys], dtype=bool
    )


@dataclass(frozen=True)
class PackedData:
    """Documents packed into rows per ``seq_len`` and split; ``batch`` draws rows by (seed, step).

    Row order within an epoch is a permutation drawn from ``(seed, epoch, split)``: step ``t``
    of batch size ``B`` takes rows ``t·B .. t·B+B−1`` of the endless sequence of epochs, so a
    batch is a function of (seed, step) alone and every row is seen once per epoch.
    """

    docs: Documents
    vocab_size: int
    source: str
    tokenizer: str = "bytes"
    method: str = "best_fit"
    meta: dict = field(default_factory=dict, compare=False, repr=False)  # the cache entry's (tokens, documents, ...)
    _plans: dict = field(default_factory=dict, compare=False, repr=False)
    _perms: dict = field(default_factory=dict, compare=False, repr=False)

    def check(self, seq_len: int) -> None:
        """Refuse (``ConfigError``) a split with nothing to pack: before a run starts."""
        for split in ("train", "valid"):
            self.plan(seq_len, split)

    def plan(self, seq_len: int, split: str = "train") -> Plan:
        """The packing of ``split`` at ``seq_len`` (computed once, then kept)."""
        key = (seq_len, split)
        if key not in self._plans:
            ids = self.docs.split(split)
            plan = plan_rows(self.docs.lengths()[ids], seq_len, self.method)
            if plan.num_rows == 0:
                raise ConfigError(f"{self.source}: the {split} split has no tokens")
            self._plans[key] = plan
        return self._plans[key]

    def rows(self, rows: Int[np.ndarray, " B"], seq_len: int, split: str = "train") -> dict[str, np.ndarray]:
        """Rows ``rows`` of the packing of ``split`` (in plan order)."""
        return materialize(self.docs, self.plan(seq_len, split), rows, self.docs.split(split))

    def _permutation(self, seed: int, epoch: int, split: str, n: int) -> np.ndarray:
        key = (seed, epoch, split, n)
        if key not in self._perms:
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng([seed, epoch, 0 if split == "train" else 1])
            self._perms[key] = rng.permutation(n)
        return self._perms[key]

    def batch(
        self, seed: int, step: int, batch_size: int, seq_len: int, *, split: str = "train",
        rows: Int[np.ndarray, " R"] | None = None,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        """``{"input_ids", "segment_ids", "positions", "loss_mask"}``, [batch_size, seq_len] each:
        the rows ``step·batch_size ...`` of the (seed, epoch)-shuffled packing of ``split``.
        ``rows``: only these rows of the batch (a process's share), read and packed alone."""
        n = self.plan(seq_len, split).num_rows
        index = step * batch_size + np.arange(batch_size, dtype=np.int64)
        index = index if rows is None else index[rows]
        picked = np.empty(len(index), np.int64)
        for epoch in np.unique(index // n).tolist():
            at = index // n == epoch
            picked[at] = self._permutation(seed, int(epoch), split, n)[index[at] % n]
        return self.rows(picked, seq_len, split)

    def num_tokens(self, split: str = "train") -> int:
        """Tokens in the documents of ``split``."""
        return int(np.sum(self.docs.lengths()[self.docs.split(split)]))

    def num_documents(self, split: str = "train") -> int:
        return len(self.docs.split(split))

    def with_method(self, method: str) -> PackedData:
        return dataclasses.replace(self, method=method, _plans={}, _perms={})
