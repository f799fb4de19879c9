"""Real data for training: tokenization with a checkpoint's tokenizer, sources (text, JSON lines,
Parquet, saved datasets), the tokenize-once cache, packing, (seed, step) batches, supervised
fine-tuning masks, clear errors on bad input and the evaluation recipe (TensorBoard: test_metrics.py).

Mostly numpy: only the recipe tests compile (the tiny fixture model, a few seconds)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES

from zoo import data
from zoo.data import DataError, PackedData, TokenData, load_data, load_tokenizer, pack_documents, plan_rows
from zoo.errors import ConfigError
from zoo.metrics_log import read_events
from zoo.train.setup import load_training_data

ROOT = Path(__file__).resolve().parents[1]
TINY = FIXTURES / "tokenizer-tiny"
TEXTS = [
    "Return the sum of two numbers.",
    "Open a file and return a stream.",
    "A class for parsing command line options and arguments, with help messages.",
    "Compute the greatest common divisor of the integers a and b.",
    "Raise an error if the value is not a positive integer.",
] * 8
TEXTS = [f"{t} (variant {i})" for i, t in enumerate(TEXTS)]


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_recipe", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _targets(seg: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Which tokens are counted targets (as zoo.loss.next_token_targets counts them)."""
    out = np.zeros_like(mask)
    out[:, 1:] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0) & mask[:, 1:]
    return out


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


# --- packing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["best_fit", "greedy"])
def test_packing_keeps_every_document_and_counts_each_target_once(method):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 70, size=60).tolist() + [16, 17, 33, 100, 2]
    starts = np.cumsum([0] + lengths)
    docs = [np.arange(s, s + n) for s, n in zip(starts, lengths)]  # every token value unique
    rows = pack_documents(docs, 16, method=method)
    assert rows.tokens.dtype == np.int32 and rows.segment_ids.dtype == np.int32 and rows.loss_mask.dtype == bool
    assert rows.tokens.shape == rows.positions.shape == rows.loss_mask.shape == (len(rows.tokens), 16)
    pad = rows.segment_ids == 0
    assert not rows.loss_mask[pad].any() and (rows.tokens[pad] == 0).all()
    targets = _targets(rows.segment_ids, rows.loss_mask)
    for r in range(len(rows.tokens)):
        seg = rows.segment_ids[r]
        ids = [s for s in np.unique(seg) if s]
        assert ids == list(range(1, len(ids) + 1))  # 1, 2, ... in a row, padding at the end
        assert (seg[: (seg > 0).sum()] > 0).all()
        for s in ids:
            at = seg == s
            piece = rows.tokens[r][at]
            assert (np.diff(piece) == 1).all()  # a contiguous slice of one document
            assert (rows.positions[r][at] == np.arange(at.sum())).all()  # positions restart at 0
    # Every token of every document but its first is a target exactly once, pieces overlapping by one.
    got = np.sort(rows.tokens[targets])
    want = np.sort(np.concatenate([d[1:] for d in docs]))
    np.testing.assert_array_equal(got, want)
    assert (rows.segment_ids > 0).sum() == sum(lengths) + sum(max(0, -(-(n - 1) // 15) - 1) for n in lengths)


def test_packing_carries_the_loss_mask_and_padding_never_counts():
    docs = [np.arange(1, 11), np.arange(20, 26), np.arange(30, 60)]
    masks = [np.arange(10) >= 4, np.ones(6, bool), np.arange(30) % 2 == 0]
    rows = pack_documents(docs, 12, loss_masks=masks)
    targets = _targets(rows.segment_ids, rows.loss_mask)
    want = sorted(
        [t for t in range(5, 11)] + [t for t in range(21, 26)] + [t for t in range(31, 60) if (t - 30) % 2 == 0]
    )
    assert sorted(rows.tokens[targets].tolist()) == want
    assert not rows.loss_mask[rows.segment_ids == 0].any()
    with pytest.raises(ConfigError, match="document 1: loss mask of 5 entries for 6 tokens"):
        pack_documents(docs, 12, loss_masks=[masks[0], masks[1][:5], masks[2]])


def test_packed_masks_are_what_the_loss_counts():
    """The numpy count above is zoo.loss.next_token_targets' (the loss the model computes)."""
    import jax.numpy as jnp

    from zoo.loss import next_token_targets

    rows = pack_documents([np.arange(5), np.arange(9), np.arange(3)], 8, loss_masks=[np.ones(5, bool), np.arange(9) > 3, np.ones(3, bool)])
    _, mask = next_token_targets(jnp.asarray(rows.tokens), jnp.asarray(rows.segment_ids), jnp.asarray(rows.loss_mask))
    np.testing.assert_array_equal(np.asarray(mask), _targets(rows.segment_ids, rows.loss_mask)[:, 1:])


def test_best_fit_pads_less_than_greedy_on_the_embedded_corpus():
    """The embedded corpus's files as byte documents (lengths only): best-fit decreasing leaves
    under 1% padding at every row length, greedy in document order several times more."""
    _, files = data.stdlib_files(8 * 2**20)
    lengths = np.array([p.stat().st_size for p in files], np.int64)
    for seq_len in (128, 1024, 4096):
        best = plan_rows(lengths, seq_len, "best_fit").padding_fraction
        greedy = plan_rows(lengths, seq_len, "greedy").padding_fraction
        assert best < 0.01 and best < greedy, (seq_len, best, greedy)
    assert plan_rows(lengths, 4096, "greedy").padding_fraction > 0.05


# --- tokenization and sources -------------------------------------------------------------------


def test_text_is_tokenized_with_bos_and_eos_as_the_checkpoint_says(tok, tmp_path):
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (256, 1, 2, True)
    d = load_data(str(_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    assert isinstance(d, PackedData) and "tokenizer.json" in d.tokenizer
    docs = d.docs
    assert len(docs) == len(TEXTS) and docs.loss_mask is None
    for i, text in enumerate(TEXTS):
        ids = np.asarray(docs.tokens[docs.offsets[i] : docs.offsets[i + 1]])
        assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1] and 2 not in ids[1:-1]
        assert tok.decode(ids[1:-1]) == text
        assert docs.nbytes[i] == len(text.encode())
    assert len(docs.split("train")) + len(docs.split("valid")) == len(TEXTS) and len(docs.split("valid")) >= 1


def test_a_tokenizer_beyond_the_model_vocabulary_is_named(tok, tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    with pytest.raises(ConfigError, match=r"tokenizer-tiny/tokenizer.json: the tokenizer's ids go up to 255 \(vocabulary 256\) but the model's vocab_size is 100"):
        load_data(str(path), 100, tokenizer=tok, cache_dir=tmp_path / "c")


def test_byte_level_data_stays_a_stream_without_a_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    d = load_data(str(tmp_path / "a.txt"), 256)
    assert isinstance(d, TokenData) and d.batch(0, 0, 2, 8).dtype == np.int32
    packed = load_data(str(_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])), 256, cache_dir=tmp_path / "c")
    assert isinstance(packed, PackedData) and packed.tokenizer.startswith("bytes")
    assert np.asarray(packed.docs.tokens[: packed.docs.offsets[1]]).tobytes() == TEXTS[0].encode()


def test_sources_agree_text_jsonl_parquet_and_saved_datasets(tok, tmp_path):
    import datasets  # pyarrow and datasets are dev dependencies
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"body": t, "n": i} for i, t in enumerate(TEXTS)]
    jl = _jsonl(tmp_path / "a.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    kw = {"tokenizer": tok, "text_field": "body", "cache_dir": tmp_path / "c", "progress": False}
    a = load_data(str(jl), 256, **kw).docs
    for spec in (tmp_path / "a.parquet", tmp_path / "ds"):
        b = load_data(str(spec), 256, **kw).docs
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
        np.testing.assert_array_equal(a.valid, b.valid)  # split by content, not by source
    files = [tmp_path / f"{i}.txt" for i in range(3)]
    for f, t in zip(files, TEXTS):
        f.write_text(t)
    t = load_data(",".join(map(str, files)), 256, tokenizer=tok, cache_dir=tmp_path / "c", progress=False).docs
    assert len(t) == 3 and np.asarray(t.tokens[t.offsets[0] : t.offsets[1]]).tolist() == np.asarray(a.tokens[a.offsets[0] : a.offsets[1]]).tolist()


def test_a_saved_dataset_dict_keeps_its_validation_split(tok, tmp_path):
    import datasets
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"text": t} for t in TEXTS[:30]]),
        "validation": datasets.Dataset.from_list([{"text": t} for t in TEXTS[30:]]),
    })  # fmt: skip
    dd.save_to_disk(str(tmp_path / "dd"))
    d = load_data(str(tmp_path / "dd"), 256, tokenizer=tok, cache_dir=tmp_path / "c", progress=False)
    assert d.docs.split("valid").tolist() == list(range(30, len(TEXTS)))


def test_hub_datasets_load_by_name(tok, tmp_path):
    """``hf:NAME`` reads with ``datasets.load_dataset(NAME)``: here a folder in a hub dataset
    repository's layout (data/train.jsonl, data/validation.jsonl), which load_dataset reads as
    it reads a downloaded repository. Its validation split is held out; new files on the hub
    (here, in the folder) are tokenized anew; a name that cannot be loaded is an error naming it."""
    repo = tmp_path / "owner" / "corpus"
    (repo / "data").mkdir(parents=True)
    _jsonl(repo / "data" / "train.jsonl", [{"text": t} for t in TEXTS[:30]])
    _jsonl(repo / "data" / "validation.jsonl", [{"text": t} for t in TEXTS[30:]])
    d = load_data(f"hf:{repo}", 256, tokenizer=tok, cache_dir=tmp_path / "c", progress=False)
    assert d.docs.split("valid").tolist() == list(range(30, len(TEXTS)))
    same = load_data(str(_jsonl(tmp_path / "all.jsonl", [{"text": t} for t in TEXTS])), 256, tokenizer=tok,
                     cache_dir=tmp_path / "c", progress=False)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(d.docs.tokens), np.asarray(same.docs.tokens))
    _jsonl(repo / "data" / "train.jsonl", [{"text": t} for t in TEXTS[:20]])
    data.sources._load_hub.cache_clear()  # as a later run would (one process loads a name once)
    fewer = load_data(f"hf:{repo}", 256, tokenizer=tok, cache_dir=tmp_path / "c", progress=False)
    assert fewer.meta["cache"] != d.meta["cache"] and len(fewer.docs) == 30
    with pytest.raises(DataError, match=r"hf:nobody/no-such-dataset.*load_dataset\('nobody/no-such-dataset'\)"):
        load_data("hf:nobody/no-such-dataset", 256, tokenizer=tok, cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match="name a dataset after hf:"):
        load_data("hf:", 256, tokenizer=tok, cache_dir=tmp_path / "c")


def test_missing_optional_readers_say_what_to_install(tok, tmp_path, monkeypatch):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"a.parquet: reading Parquet needs pyarrow: pip install 'zoo\[data\]'"):
        load_data(str(tmp_path / "a.parquet"), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match=r"ds is a Hugging Face dataset directory; reading it needs the `datasets` package"):
        load_data(str(tmp_path / "ds"), 256, tokenizer=tok, cache_dir=tmp_path / "c")


# --- the cache -----------------------------------------------------------------------------------


def test_data_is_tokenized_once_then_read_from_the_cache(tok, tmp_path, monkeypatch, capsys):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    first = load_data(str(path), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    assert "tokenized 40 documents" in capsys.readouterr().err

    def refuse(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data.corpus, "tokenize_to", refuse)
    again = load_data(str(path), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(first.docs.tokens), np.asarray(again.docs.tokens))
    for b in (first, again):
        assert b.meta["cache"] == first.meta["cache"]
    _jsonl(path, [{"text": t + "!"} for t in TEXTS])  # another size and time: tokenized anew
    with pytest.raises(AssertionError, match="tokenized again"):
        load_data(str(path), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    with pytest.raises(AssertionError, match="tokenized again"):  # other options
        load_data(str(path), 256, tokenizer=tok, cache_dir=tmp_path / "c", valid_fraction=0.2)
    assert not [p for p in (tmp_path / "c").iterdir() if ".tmp-" in p.name]  # failed attempts leave nothing


def _load_in_processes(n: int, path: Path, tok, caches: list[Path], errors: bool = False, **kw) -> list:
    """``load_data`` as ``n`` processes call it (threads here, a barrier between them);
    ``errors``: return each one's exception rather than raising the first."""
    import threading

    barrier = threading.Barrier(n, timeout=60)
    results: list = [None] * n

    def work(i: int) -> None:
        try:
            share = data.Share(i, n, lambda name: barrier.wait())
            results[i] = load_data(str(path), 256, tokenizer=tok, cache_dir=caches[i], share=share, **kw)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            # No barrier.abort() here: a thread released from the last barrier but not yet running
            # saw the abort of one that raised after it and failed with BrokenBarrierError (seen
            # under load). A thread that fails before a barrier leaves the others to its timeout.
            results[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException) and not errors:
            raise r
    return results


def _entry_files(d) -> dict[str, bytes]:
    entry = Path(d.meta["cache"])
    return {p.name: p.read_bytes() for p in sorted(entry.iterdir()) if p.name != "meta.json"}


@pytest.mark.parametrize("records", ["text", "chat"])
def test_processes_split_the_tokenizing_and_get_the_one_process_entry(tok, tmp_path, capsys, records):
    """3 processes tokenize a third of the records each; process 0 merges the parts into the
    cache entry that one process writes, byte for byte, and all three read it. A process whose
    cache directory is its own tokenizes everything itself."""
    rows = [{"text": t} for t in TEXTS] if records == "text" else CHATS + CHATS[:1]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    one = load_data(str(path), 256, tokenizer=tok, cache_dir=tmp_path / "one")
    capsys.readouterr()
    shared = _load_in_processes(3, path, tok, [tmp_path / "shared"] * 3)
    err = capsys.readouterr().err
    assert [f"tokenized part {i} of 3" in err for i in (1, 2, 3)] == [True] * 3 and err.count("merged 3 parts") == 1
    for d in shared:
        assert d.meta["cache"] == shared[0].meta["cache"] and d.meta["documents"] == len(rows)
        assert d.meta["formats"] == one.meta["formats"]
        assert _entry_files(d) == _entry_files(one)
    # Parts removed: the entry and the remembered hashes of the data files remain.
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == [Path(shared[0].meta["cache"]).name, "file-hashes.json"]
    own = _load_in_processes(3, path, tok, [tmp_path / f"own{i}" for i in range(3)])  # caches not shared
    for d in own:
        assert _entry_files(d) == _entry_files(one)
    capsys.readouterr()
    again = _load_in_processes(3, path, tok, [tmp_path / "shared"] * 3)  # cached: nothing tokenized
    assert "tokenized" not in capsys.readouterr().err
    assert _entry_files(again[1]) == _entry_files(one)


def test_data_with_nothing_to_train_on_stops_every_process(tok, tmp_path):
    """An empty data set is found by process 0 when it merges the parts; the others must not
    wait for it at the barrier: each meets the same error."""
    path = tmp_path / "d.jsonl"
    path.write_text("\n\n")
    out = _load_in_processes(2, path, tok, [tmp_path / "c"] * 2, errors=True)
    assert all(isinstance(e, DataError) and "no records" in str(e) for e in out), out


def _checkpoint_without_chat_template(tmp_path):
    """The tiny checkpoint's tokenizer files with the chat template removed."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(TINY / "tokenizer.json", ckpt)
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    return ckpt


def test_an_error_only_one_part_meets_stops_every_process(tmp_path):
    """Rendering a chat (a tokenizer without a chat template) fails only in the process whose
    share holds the chat: the other, with nothing to render, must not wait for it."""
    ckpt = _checkpoint_without_chat_template(tmp_path)
    path = _jsonl(tmp_path / "chat.jsonl", CHATS[:1])
    out = _load_in_processes(2, path, load_tokenizer(ckpt), [tmp_path / "c"] * 2, errors=True)
    assert all(isinstance(e, DataError) and "chat.jsonl:1: chat data needs a chat template" in str(e) for e in out), out


def test_a_bad_record_stops_every_process(tok, tmp_path):
    """Every process reads and checks every record, tokenizing only its own: a record without
    the text field is an error in all of them, named by file and line."""
    path = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS[:4]] + [{"body": "no text"}])
    for i in range(2):
        with pytest.raises(DataError, match=r"d.jsonl:5"):
            load_data(str(path), 256, tokenizer=tok, cache_dir=tmp_path / "c", share=data.Share(i, 2, lambda name: None))
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["file-hashes.json"]  # no entry, no part


# --- batches -------------------------------------------------------------------------------------


def test_packed_batches_depend_only_on_seed_and_step(tok, tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    a = load_data(str(path), 256, tokenizer=tok, cache_dir=tmp_path / "c", progress=False)
    b = load_data(str(path), 256, tokenizer=tok, cache_dir=tmp_path / "other", progress=False)  # tokenized afresh
    x = a.batch(3, 7, 4, 32)
    assert set(x) == {"input_ids", "segment_ids", "positions", "loss_mask"}
    assert all(v.shape == (4, 32) for v in x.values()) and x["input_ids"].dtype == np.int32 and x["loss_mask"].dtype == bool
    for k in x:
        np.testing.assert_array_equal(x[k], b.batch(3, 7, 4, 32)[k])
    assert not np.array_equal(x["input_ids"], a.batch(3, 8, 4, 32)["input_ids"])
    assert not np.array_equal(x["input_ids"], a.batch(4, 7, 4, 32)["input_ids"])
    # An epoch shows every row once; the next epoch another order.
    n = a.plan(32).num_rows
    seen = np.concatenate([a.batch(0, s, 1, 32)["input_ids"] for s in range(n)])
    every = a.rows(np.arange(n), 32)["input_ids"]
    assert sorted(map(bytes, seen)) == sorted(map(bytes, every))
    # Validation rows come from held-out documents only.
    v = a.batch(0, 0, 2, 32, split="valid")
    held = {bytes(np.asarray(a.docs.tokens[a.docs.offsets[d] : a.docs.offsets[d + 1]])) for d in a.docs.split("valid")}
    for r in range(2):
        for s in set(v["segment_ids"][r].tolist()) - {0}:
            piece = bytes(v["input_ids"][r][v["segment_ids"][r] == s].astype(a.docs.tokens.dtype))
            assert any(piece in h for h in held)


# --- supervised fine-tuning -----------------------------------------------------------------------

CHATS = [
    {"messages": [{"role": "system", "content": "You answer in one sentence."},
                  {"role": "user", "content": "What does len return?"},
                  {"role": "assistant", "content": "The number of items in a container."},
                  {"role": "user", "content": "And for a string?"},
                  {"role": "assistant", "content": "The number of characters."}]},
    {"messages": [{"role": "user", "content": "Name a sorting function."},
                  {"role": "assistant", "content": "sorted(iterable, key=None, reverse=False)"}]},
] * 3  # fmt: skip


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_chat_loss_mask_is_the_assistants_turns(tok, tmp_path):
    """The masked-in tokens decode to exactly each assistant message's content followed by the
    template's end-of-turn token <|im_end|> (the newline after it is not learned)."""
    d = load_data(str(_jsonl(tmp_path / "chat.jsonl", CHATS)), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    docs = d.docs
    assert docs.loss_mask is not None and d.meta["formats"] == {"chat": len(CHATS)}
    chat = data.ChatEncoder(tok)
    for i, record in enumerate(CHATS):
        a, b = docs.offsets[i], docs.offsets[i + 1]
        ids, mask = np.asarray(docs.tokens[a:b]), np.asarray(docs.loss_mask[a:b])
        assert tok.decode(ids) == chat.render(record["messages"])  # the template's own text, BOS included
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert [tok.decode(ids[s:e]) for s, e in _runs(mask)] == [r + "<|im_end|>" for r in replies]
        assert docs.nbytes[i] == sum(len((r + "<|im_end|>").encode()) for r in replies)
    # Packed, the masked targets are those tokens.
    rows = d.rows(np.arange(d.plan(512, "all").num_rows), 512, "all")
    assert _targets(rows["segment_ids"], rows["loss_mask"]).sum() == int(np.sum(docs.loss_mask))


def test_prompt_completion_pairs_learn_the_completion_only(tok, tmp_path):
    pairs = [{"prompt": "def add(a, b):\n", "completion": "    return a + b"}] * 4
    d = load_data(str(_jsonl(tmp_path / "p.jsonl", pairs)), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    ids, mask = np.asarray(d.docs.tokens[: d.docs.offsets[1]]), np.asarray(d.docs.loss_mask[: d.docs.offsets[1]])
    assert ids[0] == 1 and ids[-1] == 2  # BOS prompt completion EOS
    (s, e), = _runs(mask)
    assert e == len(ids) and tok.decode(ids[s : e - 1]) == "    return a + b" and tok.decode(ids[1:s]) == "def add(a, b):\n"


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "fine"}', '{"body": "oops"}'], r"bad.jsonl:2: no field 'text' \(fields: 'body'\); choose the text's field with --text-field"),
        (['{"text": "fine"}', "", '{"text": "broken'], r"bad.jsonl:3: not valid JSON: Unterminated string starting at \(column 10\)"),
        (['["a", "b"]'], r"bad.jsonl:1: expected a JSON object per line, got list"),
        (['{"text": 3}'], r"bad.jsonl:1: field 'text' is int, not a string"),
        ([], r"--data .*bad.jsonl: no records \(an empty dataset\)"),
        (['{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}'],
         r"bad.jsonl:1: messages\[1\] has unknown role 'robot' \(expected one of system, user, assistant\)"),
        (['{"messages": [{"role": "user", "content": "hi"}]}'], r"bad.jsonl:1: no assistant message"),
        (['{"prompt": "a", "completion": null}'], r"bad.jsonl:1: field 'completion' is NoneType, not a string"),
    ],
)  # fmt: skip
def test_bad_records_are_named_by_file_and_line(tok, tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(DataError, match=message):
        load_data(str(path), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    assert not [p for p in (tmp_path / "c").iterdir() if ".tmp-" in p.name]


def test_chat_data_without_a_template_is_an_error(tmp_path):
    ckpt = _checkpoint_without_chat_template(tmp_path)
    path = _jsonl(tmp_path / "chat.jsonl", CHATS)
    with pytest.raises(DataError, match=r"chat.jsonl:1: chat data needs a chat template, and .*ckpt has none"):
        load_data(str(path), 256, tokenizer=load_tokenizer(ckpt), cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match="the byte-level tokenizer"):
        load_data(str(path), 256, cache_dir=tmp_path / "c")


def test_other_bad_specs(tok, tmp_path):
    with pytest.raises(DataError, match="nope.jsonl is not a file"):
        load_data(str(tmp_path / "nope.jsonl"), 256, tokenizer=tok)
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="is a directory but not a dataset saved with `datasets`"):
        load_data(str(tmp_path / "d"), 256, tokenizer=tok)
    (tmp_path / "x.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(DataError, match=r"x.txt: not UTF-8 text \(byte 3"):
        load_data(str(tmp_path / "x.txt"), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match="data format must be one of"):
        load_data(str(tmp_path / "x.txt"), 256, tokenizer=tok, data_format="poetry")


# --- the recipes ---------------------------------------------------------------------------------


def test_eval_recipe_reports_loss_perplexity_and_bits_per_byte(tmp_path, capsys):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS * 3])
    out = _recipe("eval").main([str(TINY), "--data", str(path), "--split", "all", "--seq-len", "64", "--batch-size", "4",
                                "--data-cache", str(tmp_path / "c"), "--json", str(tmp_path / "r.json")])  # fmt: skip
    printed = capsys.readouterr().out
    assert "tokenizer.json" in printed and "bits per byte" in printed
    d = load_data(str(path), 256, tokenizer=load_tokenizer(TINY), cache_dir=tmp_path / "c")
    assert out["tokens"] == d.num_tokens("all") - len(d.docs) and not out["bytes_estimated"]  # every token after BOS
    assert out["bytes"] == sum(len(t.encode()) for t in TEXTS * 3)
    assert abs(out["loss"] - math.log(256)) < 0.3  # a random initialisation
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]))
    assert out["bits_per_byte"] == pytest.approx(out["loss"] * out["tokens"] / math.log(2) / out["bytes"])
    assert json.loads((tmp_path / "r.json").read_text())["tokens"] == out["tokens"]
    with pytest.raises(SystemExit):
        _recipe("eval").main([str(TINY), "--data", str(path), "--seq-len", "4096"])
    assert "beyond the model's max_position_embeddings 2048" in capsys.readouterr().err


def test_train_setup_tokenizes_with_the_checkpoint_and_refuses_bad_data(tmp_path, capsys):
    path = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    d = load_training_data(str(path), 256, checkpoint=str(TINY), seq_len=128, cache_dir=str(tmp_path / "c"))
    assert isinstance(d, PackedData) and "tokenizer: " + str(TINY / "tokenizer.json") in capsys.readouterr().out
    _jsonl(path, [{"content": "x"}])
    with pytest.raises(ConfigError, match=r"d.jsonl:1: no field 'text' \(fields: 'content'\)"):
        load_training_data(str(path), 256, checkpoint=str(TINY), seq_len=128, cache_dir=str(tmp_path / "c"))
    (tmp_path / "a.txt").write_text("bytes as before " * 400)
    assert isinstance(load_training_data(str(tmp_path / "a.txt"), 256, checkpoint=None, seq_len=128), TokenData)
    assert "tokenizer: bytes" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the recipe: a usage error naming the record
        _recipe("train").main(["--data", str(path), "--data-cache", str(tmp_path / "c"), "--checkpoint", str(TINY),
                               "--run-dir", str(tmp_path / "run"), "--steps", "1"])  # fmt: skip
    assert "d.jsonl:1: no field 'text' (fields: 'content')" in capsys.readouterr().err


def test_text_streams_a_piece_per_token():
    """Characters a token ends halfway through wait for the token that completes them; the
    spaces a tokenizer puts between tokens come with the token they precede."""
    text = "naïve café ✓ done"
    stream = data.TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    pieces = [stream.add(b) for b in text.encode()]
    assert "".join(pieces) == text
    assert pieces[2:4] == ["", "ï"] and pieces[-8:-5] == ["", "", "✓"]  # 2 and 3 bytes: shown when whole
    words = ["hello", "world", "again"]  # a decoder that joins tokens with spaces (no token holds one)
    stream = data.TextStream(lambda ids: " ".join(words[i] for i in ids))
    assert [stream.add(i) for i in range(3)] == ["hello", " world", " again"]
    tokenizer = load_tokenizer(TINY)  # the checkpoint's tokenizer.json: its decoding of the whole, a piece at a time
    ids = tokenizer.encode_batch(["def stream(self):\n    return self.text"])[0].tolist()
    stream = data.TextStream(tokenizer.decode)
    assert "".join(stream.add(i) for i in ids) == tokenizer.decode(ids) == "def stream(self):\n    return self.text"


def test_saved_checkpoints_keep_the_tokenizer(tmp_path):
    assert data.copy_tokenizer_files(TINY, tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    a, b = load_tokenizer(tmp_path), load_tokenizer(TINY)
    assert (a.vocab_size, a.bos_id, a.eos_id, a.add_bos, a.chat_template) == (b.vocab_size, b.bos_id, b.eos_id, b.add_bos, b.chat_template)


def test_fine_tuning_saves_a_checkpoint_with_the_tokenizer_and_sampling_settings(tmp_path):
    """The README's fine-tuning line, end to end: --save-hf writes trained weights that load,
    beside the source checkpoint's tokenizer files and generation settings."""
    import zoo

    source = tmp_path / "base"
    shutil.copytree(TINY, source)
    settings = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (source / "generation_config.json").write_text(json.dumps(settings))
    path = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "tuned"
    _recipe("train").main(["--checkpoint", str(source), "--data", str(path), "--data-cache", str(tmp_path / "c"),
                           "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--run-dir", str(tmp_path / "run"),
                           "--save-hf", str(out), "--peak-tflops", "1"])  # fmt: skip
    tuned, base = zoo.from_pretrained(out), zoo.from_pretrained(source)
    assert not np.array_equal(np.asarray(tuned.embed), np.asarray(base.embed))  # trained
    assert json.loads((out / "generation_config.json").read_text()) == settings
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


def test_training_on_packed_chats_resumes_batch_for_batch(tok, tmp_path):
    """Through zoo.train: packed SFT batches (dicts with the loss mask) train, and a resumed run's
    losses equal an uninterrupted run's, with no loader state saved."""
    import zoo
    from zoo import train as ztrain

    d = load_data(str(_jsonl(tmp_path / "chat.jsonl", CHATS * 4)), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    model = zoo.from_pretrained(TINY)
    cfg = ztrain.TrainConfig(steps=4, batch_size=2, seq_len=64, warmup=1, lr=3e-3, log_every=1, eval_every=2,
                             eval_batches=1, checkpoint_every=2)  # fmt: skip
    _, full = ztrain.train(model, d, cfg, run_dir=tmp_path / "full")
    ztrain.train(model, d, cfg, run_dir=tmp_path / "cut", stop_after=2)
    _, rest = ztrain.train(model, d, cfg, run_dir=tmp_path / "cut", resume=True)
    full = [r for r in full if "loss" in r]
    assert [r["step"] for r in rest] == [3, 4] and all(math.isfinite(r["loss"]) for r in full)
    np.testing.assert_array_equal([r["loss"] for r in full[2:]], [r["loss"] for r in rest])
    # TensorBoard's event file beside metrics.jsonl holds the same losses.
    (events,) = (tmp_path / "full").glob("events.out.tfevents.*")
    logged = {e["step"]: e["scalars"]["loss"] for e in read_events(events)[1:] if "loss" in e.get("scalars", {})}
    assert logged == {r["step"]: pytest.approx(r["loss"]) for r in full}


@pytest.mark.parametrize("post_processor, add_bos", [(True, True), (False, False)])
def test_bos_follows_the_post_processor_when_the_config_does_not_say(tmp_path, post_processor, add_bos):
    """Llama 3's tokenizer_config.json has no add_bos_token: its tokenizer.json's post-processor
    adds <|begin_of_text|>. Qwen's adds nothing."""
    from tokenizers import Tokenizer, processors

    t = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    if post_processor:
        t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    t.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    del config["add_bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.add_bos is add_bos and tok.bos_id == 1
    d = load_data(str(_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])), 256, tokenizer=tok, cache_dir=tmp_path / "c")
    first = np.asarray(d.docs.tokens[: d.docs.offsets[1]])
    assert bool(first[0] == 1) is add_bos and first[-1] == 2 and (first == 1).sum() == int(add_bos)  # never twice


def test_the_documented_corpus_command_leaves_the_committed_fixture_alone(tmp_path):
    """docs/data.md's ``make_tokenizer_tiny.py --jsonl`` rewrote tests/fixtures/tokenizer-tiny;
    the checkpoint is written only where ``--out`` says."""
    folder = FIXTURES / "tokenizer-tiny"
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    spec = importlib.util.spec_from_file_location("make_tokenizer_tiny", folder / "make_tokenizer_tiny.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--jsonl", str(tmp_path / "docstrings.jsonl")])
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    lines = (tmp_path / "docstrings.jsonl").read_text().splitlines()
    assert len(lines) == len(script.docstrings()) and all(json.loads(line)["text"] for line in lines)
    if sys.version_info[:2] == (3, 11):  # docs/data.md's figure is Python 3.11's standard library
        assert len(lines) == 7335
    with pytest.raises(SystemExit):
        script.main([])
