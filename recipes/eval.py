"""Evaluate a checkpoint on held-out data: loss, perplexity and bits per byte.

    python recipes/eval.py tests/fixtures/tokenizer-tiny --data docstrings.jsonl    # its held-out split
    python recipes/eval.py path/to/Llama-3.2-1B --data test.jsonl --split all        # every document of a test file
    python recipes/eval.py path/to/ckpt --data chats.jsonl                           # chats: the assistant's tokens

The data is read, tokenized (with the checkpoint's tokenizer.json, else bytes) and split exactly
as ``recipes/train.py`` does, so ``--split valid`` (the default) is the data training held out.
Every packed row of the split is evaluated once: every target token of every document counts
exactly once. Bits per byte = total nats / ln 2 / UTF-8 bytes of the text those targets encode
(the documents' text; for chats and prompt/completion pairs the assistant's turns and the
completions), which does not depend on the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from zoo.cli import Help, positive_int


def json_target(text: str) -> str:
    """``--json``'s file: where it can be written, known before the evaluation runs."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name a file in it")
    if not path.absolute().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {path.absolute().parent} does not exist; create it first")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("checkpoint", help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json), "
                   "a recipes/train.py run directory (its latest good checkpoint), or a Hugging Face hub id (org/name)")
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, as train.py "
                        "--save-adapter or peft writes it) merged into the checkpoint first")
    p.add_argument("--qlora", default=None, choices=["fp8", "int8", "nf4"],
                   help="with --adapter: merge it into the checkpoint's layer stacks quantized so, as its QLoRA run "
                        "(train.py --qlora) trained it")  # fmt: skip
    p.add_argument("--data", default="stdlib", help="as recipes/train.py's --data (default: the embedded corpus)")
    p.add_argument("--text-field", default="text", help="the field of a record that holds its text")
    p.add_argument("--data-format", choices=["auto", "text", "chat", "completion"], default="auto",
                   help="as recipes/train.py's --data-format")  # fmt: skip
    p.add_argument("--data-cache", default=None, help="where tokenized data is cached (default ~/.cache/zoo/data)")
    p.add_argument("--split", choices=["valid", "train", "all"], default="valid",
                   help="the held-out documents (default), the training ones, or all")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per packed row (default: a run directory's own --seq-len, else 512)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass")
    p.add_argument("--max-rows", type=positive_int, default=None,
                   help="evaluate only the first N rows (>= 1; bytes then estimated)")  # fmt: skip
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32", help="activation dtype")
    p.add_argument("--json", type=json_target, default=None,
                   help="also write the figures to this JSON file (its folder must exist)")  # fmt: skip
    return p


def target_count(batch: dict) -> int:
    """Predictions ``zoo.lm_loss`` averages over: token t+1 from t in one non-zero segment, the
    target's loss_mask set."""
    seg, mask = batch["segment_ids"], batch["loss_mask"]
    return int(((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0) & mask[:, 1:]).sum())


def split_targets(data, split: str) -> int:
    """Targets of a split's documents: every token after the first whose loss_mask is set."""
    import numpy as np

    docs, total = data.docs, 0
    for d in docs.split(split).tolist():
        a, b = int(docs.offsets[d]), int(docs.offsets[d + 1])
        total += (b - a - 1) if docs.loss_mask is None else int(np.sum(docs.loss_mask[a + 1 : b])) if b > a else 0
    return total


def load_model(path: str, compute_dtype, p: argparse.ArgumentParser):
    """The model of a Hugging Face checkpoint or of a training run directory, and the run's
    settings (``{}`` for a checkpoint); a usage error naming the directory otherwise."""
    from zoo import train
    from zoo.errors import CheckpointError, ConfigError

    try:
        return train.load_model(path, compute_dtype=compute_dtype)
    except (CheckpointError, ConfigError, OSError) as e:
        p.error(str(e))


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    import jax.numpy as jnp

    from zoo.errors import CheckpointError
    from zoo.hf import hub

    try:  # a hub id ("org/name") that is no local folder: its snapshot in the hub cache, tokenizer included
        args.checkpoint = str(hub.resolve(args.checkpoint))
    except CheckpointError as e:
        p.error(str(e))
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.compute_dtype]
    model, settings = load_model(args.checkpoint, dtype, p)
    if args.adapter is not None:
        from zoo.errors import ConfigError
        from zoo.lora.formats import merged_adapter

        try:
            model = merged_adapter(model, args.adapter, quantized=args.qlora)
        except (CheckpointError, ConfigError, OSError) as e:
            p.error(f"--adapter {args.adapter}: {e}")
    elif args.qlora is not None:
        p.error("--qlora goes with --adapter")
    if args.seq_len is None:
        args.seq_len = int(settings.get("train", {}).get("seq_len", 512))
    for name in ("seq_len", "batch_size"):
        if getattr(args, name) < (2 if name == "seq_len" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'seq_len' else 1}, got {getattr(args, name)}")
    import equinox as eqx
    import numpy as np

    import zoo
    from zoo import data as zdata
    from zoo.errors import ConfigError

    limit = model.config.max_position_embeddings
    if args.seq_len > limit:
        p.error(f"--seq-len {args.seq_len} is beyond the model's max_position_embeddings {limit}")
    try:
        tokenizer = zdata.load_tokenizer(args.checkpoint)
        print(f"tokenizer: {tokenizer.describe()}", flush=True)
        data = zdata.load_data(args.data, model.config.vocab_size, tokenizer=tokenizer, text_field=args.text_field,
                               data_format=args.data_format, cache_dir=args.data_cache, packed=True)  # fmt: skip
        plan = data.plan(args.seq_len, args.split)
    except ConfigError as e:
        p.error(str(e))
    rows = plan.num_rows if args.max_rows is None else min(plan.num_rows, args.max_rows)
    nbytes = int(np.sum(data.docs.nbytes[data.docs.split(args.split)]))
    expected = split_targets(data, args.split)

    @eqx.filter_jit
    def loss_fn(model, ids, positions, segment_ids, loss_mask):
        return zoo.lm_loss(model, ids, positions=positions, segment_ids=segment_ids, loss_mask=loss_mask)

    nats, count, start = 0.0, 0, time.perf_counter()
    batches, last = -(-rows // args.batch_size), start
    print(f"evaluating {rows:,} rows of {args.seq_len} tokens in {batches:,} batches of {args.batch_size}", flush=True)
    for first in range(0, rows, args.batch_size):
        if time.perf_counter() - last > 10:  # a progress line every 10 s or so
            last = time.perf_counter()
            print(f"  batch {first // args.batch_size + 1:,}/{batches:,} ({last - start:.0f} s)", flush=True)
        index = np.arange(first, min(first + args.batch_size, rows))
        batch = data.rows(index, args.seq_len, args.split)
        if len(index) < args.batch_size:  # padding rows: segment 0, nothing counts; one compiled shape
            batch = {k: np.concatenate([v, np.zeros((args.batch_size - len(index), args.seq_len), v.dtype)])
                     for k, v in batch.items()}  # fmt: skip
        n = target_count(batch)
        if n == 0:
            continue
        loss = loss_fn(model, *(jnp.asarray(batch[k]) for k in ("input_ids", "positions", "segment_ids", "loss_mask")))
        nats += float(loss) * n
        count += n
    if count == 0:
        p.error(f"--data {args.data}: the {args.split} split has no target tokens")
    if rows == plan.num_rows and count != expected:
        raise AssertionError(f"counted {count} targets, the documents have {expected}")
    estimated = count != expected
    if estimated:
        nbytes = round(nbytes * count / expected)
    loss = nats / count
    result = {
        "checkpoint": args.checkpoint, "data": data.source, "split": args.split, "tokenizer": data.tokenizer,
        "documents": data.num_documents(args.split), "rows": rows, "seq_len": args.seq_len, "tokens": count,
        "bytes": nbytes, "bytes_estimated": estimated, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": nats / math.log(2) / max(nbytes, 1), "seconds": round(time.perf_counter() - start, 2),
    }  # fmt: skip
    print(f"{args.checkpoint} on {data.source} [{args.split}]: {result['documents']:,} documents, {rows:,} rows of "
          f"{args.seq_len}, {count:,} predicted tokens, {nbytes:,} bytes{' (estimated)' if estimated else ''}")  # fmt: skip
    print(f"loss {loss:.4f} nats/token   perplexity {result['perplexity']:.3f}   bits per byte {result['bits_per_byte']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
