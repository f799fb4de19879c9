"""Load a Hugging Face checkpoint directory and print the model's next-token predictions.

    python recipes/predict.py [CHECKPOINT_DIR] [--prompt TEXT] [--top K]

Without a directory it uses the tiny Llama 3.1 checkpoint shipped in tests/fixtures. The
prompt is tokenized with the checkpoint's tokenizer.json (its BOS as its tokenizer_config.json
says), bytes where it has none, and every token is printed as its text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

import zoo
from zoo.cli import Help

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llama3_1-tiny"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    parser.add_argument("checkpoint", nargs="?", default=str(DEFAULT), help="checkpoint directory (config.json + safetensors), or a Hugging Face hub id")
    parser.add_argument("--prompt", default="The quick brown fox", help="text, tokenized with the checkpoint's tokenizer")
    parser.add_argument("--top", type=int, default=5, help="how many candidates to show per position")
    args = parser.parse_args(argv)

    from zoo import data as zdata
    from zoo.errors import CheckpointError, ConfigError
    from zoo.hf import hub

    try:  # a hub id ("org/name") that is no local folder: its snapshot in the hub cache, tokenizer included
        args.checkpoint = str(hub.resolve(args.checkpoint))
    except CheckpointError as e:
        parser.error(str(e))
    model = zoo.from_pretrained(args.checkpoint)
    vocab = model.config.vocab_size
    try:
        tokenizer = zdata.load_tokenizer(args.checkpoint)
        zdata.check_vocabulary(tokenizer, vocab)
    except ConfigError as e:
        parser.error(str(e))
    ids = ([tokenizer.bos_id] if tokenizer.add_bos else []) + tokenizer.encode_batch([args.prompt])[0].tolist()
    if len(ids) < 2:
        parser.error("--prompt needs at least two tokens")
    input_ids = jnp.asarray([ids], dtype=jnp.int32)
    logits = jax.jit(lambda m, x: m(x))(model, input_ids)
    loss = jax.jit(zoo.lm_loss)(model, input_ids)
    print(f"{type(model).__name__} from {args.checkpoint}: {model.config.num_layers} layers, vocab {vocab}; "
          f"tokenizer {tokenizer.describe()}")  # fmt: skip
    print(f"next-token loss on the prompt: {float(loss):.4f}")
    probs = jax.nn.softmax(logits[0], axis=-1)
    top_p, top_i = jax.lax.top_k(probs, args.top)
    for t in range(len(ids)):
        cands = ", ".join(f"{piece(tokenizer, int(i))}:{float(p):.3f}" for p, i in zip(top_p[t], top_i[t]))
        print(f"  after {piece(tokenizer, ids[t]):>10}  ->  {cands}")


def piece(tokenizer, token: int) -> str:
    """One token as text, quoted (spaces and newlines visible); a byte that is not a whole
    character as its escape."""
    from zoo.data import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return repr(bytes([token]))[1:] if token < 256 else f"<{token}>"
    return repr(tokenizer.decode([token]))


if __name__ == "__main__":
    main()
