"""Load a Hugging Face checkpoint directory and print the model's next-token predictions.

    python recipes/predict.py [CHECKPOINT_DIR] [--prompt TEXT] [--top K]

Without a directory it uses the tiny Llama 3.1 checkpoint shipped in tests/fixtures. Tokens
are bytes (the tiny checkpoints have a 256-token vocabulary).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llama3_1-tiny"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default=str(DEFAULT), help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--prompt", default="The quick brown fox", help="text, encoded as bytes")
    parser.add_argument("--top", type=int, default=5, help="how many candidates to show per position")
    args = parser.parse_args(argv)

    model = zoo.from_pretrained(args.checkpoint)
    vocab = model.config.vocab_size
    ids = [b % vocab for b in args.prompt.encode()]
    if len(ids) < 2:
        parser.error("--prompt needs at least two bytes")
    input_ids = jnp.asarray([ids], dtype=jnp.int32)
    logits = jax.jit(lambda m, x: m(x))(model, input_ids)
    loss = jax.jit(zoo.lm_loss)(model, input_ids)
    print(f"{type(model).__name__} from {args.checkpoint}: {model.config.num_layers} layers, vocab {vocab}")
    print(f"next-token loss on the prompt: {float(loss):.4f}")
    probs = jax.nn.softmax(logits[0], axis=-1)
    top_p, top_i = jax.lax.top_k(probs, args.top)
    for t in range(len(ids)):
        cands = ", ".join(f"{int(i)}:{float(p):.3f}" for p, i in zip(top_p[t], top_i[t]))
        print(f"  after {bytes([ids[t] % 256])!r:>7}  ->  {cands}")


if __name__ == "__main__":
    main()
