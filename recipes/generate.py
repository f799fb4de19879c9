"""Generate text from a Hugging Face checkpoint directory, streaming tokens as they come.

    python recipes/generate.py [CHECKPOINT_DIR] [--prompt TEXT ...] [--max-new-tokens N]
                               [--temperature T] [--top-k K] [--top-p P] [--seed S]
                               [--eos ID[,ID...] | --ignore-eos] [--mla absorbed|reexpand|expanded]
                               [--chat [TEXT] [--system TEXT]]

Without a directory it loads the tiny Llama 3.1 checkpoint in tests/fixtures (random
weights: expect noise); a recipes/train.py run directory works too (its latest good
checkpoint). The prompt is tokenized with the checkpoint's tokenizer.json when it has one,
as bytes otherwise. ``--chat "question"`` (and ``--system``) renders a conversation with the
checkpoint's chat template and streams the answer to the end of its turn; ``--chat`` alone
keeps a conversation going, a line at a time. Several --prompt flags make a batch of prompts of different lengths; the
first streams, and every completion is printed at the end. Generation stops at the
checkpoint's end-of-sequence tokens (generation_config.json, else config.json) unless
--eos or --ignore-eos says otherwise. Temperature 0 (the default) is greedy decoding.

Reports the compile time, then prefill tokens/s (prompt tokens over the time to the first
new token) and decode tokens/s (tokens after the first, all rows, over the time they took).
"""

from __future__ import annotations

import argparse
import codecs
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import zoo
from zoo import generate as gen
from zoo.cli import Help, positive_int
from zoo.core import registry
from zoo.data import TextStream

# The keyword options of the families' generation caches (DeepSeek-V3's MLA decoding ...), a flag each.
CACHE_OPTIONS = {name: option for family in registry.families() for name, option in family.cache_options.items()}

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llama3_1-tiny"


class ByteTokenizer:
    """One token per byte (the tiny checkpoints' 256-token vocabulary)."""

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"byte tokens need a vocabulary of at least 256, the model has {vocab_size}")
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def stream(self, token: int) -> str:
        return self.decoder.decode(bytes([token])) if token < 256 else ""

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode(errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json through the `tokenizers` library, decoding a stream of tokens."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path))
        self.text = TextStream(self.tok.decode)  # the completion decoded whole each time: characters and spaces right

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def stream(self, token: int) -> str:
        return self.text.add(token)

    def decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)


def parse_eos(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--eos takes token ids separated by commas, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"--eos takes non-negative token ids separated by commas, got {text!r}")
    return ids


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
    p.add_argument("checkpoint", nargs="?", default=str(DEFAULT),
                   help="checkpoint directory (config.json + safetensors), a recipes/train.py run directory, or a "
                        "Hugging Face hub id (org/name)")  # fmt: skip
    p.add_argument("--adapter", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, as train.py "
                        "--save-adapter or peft writes it) merged into the checkpoint first")
    p.add_argument("--qlora", default=None, choices=["fp8", "int8", "nf4"],
                   help="with --adapter: merge it into the checkpoint's layer stacks quantized so, as its QLoRA run "
                        "(train.py --qlora) trained it")  # fmt: skip
    p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch (default: 'The quick brown fox')")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens holding mass P (0 < P <= 1)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling (default 0)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--eos", type=parse_eos, default=None, metavar="ID[,ID...]",
                      help="end-of-sequence token ids (default: the checkpoint's generation_config.json)")  # fmt: skip
    stop.add_argument("--ignore-eos", action="store_true", help="never stop before --max-new-tokens")
    for name, (choices, text) in CACHE_OPTIONS.items():  # --mla ...: the family's default where not given
        p.add_argument(f"--{name.replace('_', '-')}", choices=choices, default=None, help=text)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype (default: the checkpoint's)")
    p.add_argument("--bytes", action="store_true", help="tokenize as bytes even if the checkpoint has a tokenizer.json")
    p.add_argument("--chat", nargs="?", const="", default=None, metavar="TEXT",
                   help="ask TEXT as a chat: rendered with the checkpoint's chat template (its default system prompt "
                        "included), answer streamed until the end of the turn; without TEXT, an interactive "
                        "conversation read from standard input (an empty line or end of input stops)")  # fmt: skip
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    return p


def end_of_turn(encoder, tokenizer) -> set[int]:
    """The special token the chat template closes an assistant's turn with (``<|im_end|>``,
    ``<|eot_id|>``): what it renders right after an answer, where that is one special token."""
    marker = "zoo-end-of-turn-probe"
    text = encoder.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}])
    after = text[text.index(marker) + len(marker) :]
    ids = tokenizer.encode_batch([after])[0].tolist() if after else []
    special = set(tokenizer.tok.get_added_tokens_decoder())
    return {ids[0]} if ids and ids[0] in special else set()


def chat(args: argparse.Namespace, model, path: Path, p: argparse.ArgumentParser, eos: tuple[int, ...]) -> list[str]:
    """``--chat``: one question, or a conversation read line by line; returns the answers."""
    from zoo import data as zdata

    tokenizer = zdata.load_tokenizer(path)
    try:
        encoder = zdata.ChatEncoder(tokenizer)
    except zoo.ConfigError as e:
        p.error(f"--chat: {e}")
    stop = tuple(sorted(set(eos) | end_of_turn(encoder, tokenizer) | ({tokenizer.eos_id} - {None})))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    answers = []
    questions = [args.chat] if args.chat else _lines()
    for question in questions:
        messages.append({"role": "user", "content": question})
        ids = tokenizer.encode_batch([encoder.render(messages, add_generation_prompt=True)])[0]
        if len(ids) + args.max_new_tokens > model.config.max_position_embeddings:
            p.error(f"the conversation ({len(ids)} tokens) and --max-new-tokens pass the model's positions")
        streamer, reply = HFTokenizer(path / "tokenizer.json"), []
        for step in gen.stream(model, jnp.asarray([ids], jnp.int32), None, max_new_tokens=args.max_new_tokens,
                               key=jax.random.key(args.seed), temperature=args.temperature, top_k=args.top_k,
                               top_p=args.top_p, eos_token_id=stop):  # fmt: skip
            token = int(step[0])
            if token in stop:
                break
            reply.append(token)
            print(streamer.stream(token), end="", flush=True)
        print(flush=True)
        answers.append(tokenizer.decode(reply))
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


def _lines():
    """Questions typed on standard input, one a line, until an empty line or its end."""
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    from zoo.errors import CheckpointError
    from zoo.hf import hub

    try:  # a hub id ("org/name") that is no local folder: its snapshot in the hub cache
        path = hub.resolve(args.checkpoint)
    except CheckpointError as e:
        p.error(str(e))
    if not (path / "config.json").is_file():
        p.error(f"{path} is not a checkpoint directory or a training run directory (no config.json)")
    try:
        gen.check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        message = str(e).replace(" or None", "").replace("temperature", "--temperature")
        p.error(message.replace("top_k", "--top-k").replace("top_p", "--top-p"))
    if args.chat is not None and args.prompt:
        p.error("--chat and --prompt exclude each other: a chat renders its own prompt")
    if args.system is not None and args.chat is None:
        p.error("--system goes with --chat")
    if args.qlora is not None and args.adapter is None:
        p.error("--qlora goes with --adapter")
    prompts = args.prompt or ["The quick brown fox"]

    from zoo import train
    from zoo.lora.formats import merged_adapter

    try:
        model, _ = train.load_model(path, compute_dtype=None if args.dtype is None else jnp.dtype(args.dtype))
        if args.adapter is not None:
            model = merged_adapter(model, args.adapter, quantized=args.qlora)
    except (zoo.CheckpointError, zoo.ConfigError) as e:
        p.error(str(e) if args.adapter is None else f"--adapter {args.adapter}: {e}")
    vocab = model.config.vocab_size
    use_hf = (path / "tokenizer.json").is_file() and not args.bytes
    make_tokenizer = (lambda: HFTokenizer(path / "tokenizer.json")) if use_hf else (lambda: ByteTokenizer(vocab))
    try:
        tokenizers = [make_tokenizer() for _ in prompts]
    except ValueError as e:
        p.error(str(e))
    encoded = [t.encode(text) for t, text in zip(tokenizers, prompts)]
    if any(not ids for ids in encoded):
        p.error("every --prompt needs at least one token")
    if max(max(ids) for ids in encoded) >= vocab:
        p.error(f"the prompt has token ids beyond the model's vocabulary of {vocab}")
    eos = () if args.ignore_eos else (args.eos if args.eos is not None else gen.eos_token_ids(path))
    if eos and max(eos) >= vocab:
        p.error(f"--eos {max(eos)} is outside the model's vocabulary 0..{vocab - 1}")
    if args.chat is not None:
        return {"answers": chat(args, model, path, p, eos)}
    ids, lengths = gen.pad_prompts(encoded)
    kw = {
        "max_new_tokens": args.max_new_tokens, "key": jax.random.key(args.seed), "temperature": args.temperature,
        "top_k": args.top_k, "top_p": args.top_p, "eos_token_id": eos,
    }  # fmt: skip
    # The cache options given (a family whose cache takes none refuses them, named: a usage error below).
    kw.update({name: getattr(args, name) for name in CACHE_OPTIONS if getattr(args, name) is not None})

    print(f"{type(model).__name__} from {path}: {model.config.num_layers} layers, vocab {vocab}, "
          f"{'tokenizer.json' if use_hf else 'byte'} tokens, end of sequence {list(eos) or 'off'}")  # fmt: skip
    # Compile the prefill and the decode step for these shapes first (two steps of the same
    # program), so the timings below are of the computation alone.
    t0 = time.perf_counter()
    try:
        for i, _ in enumerate(gen.stream(model, ids, lengths, **{**kw, "eos_token_id": ()})):
            if i == 1:
                break
    except ValueError as e:  # a request past the model's positions, say
        p.error(str(e))
    compile_s = time.perf_counter() - t0
    print(f"compiled (and warmed up) in {compile_s:.1f} s\n")
    print(prompts[0], end="", flush=True)

    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    start = time.perf_counter()
    first = None
    for step in gen.stream(model, ids, lengths, **kw):
        first = first or time.perf_counter()
        for row, token in enumerate(step.tolist()):
            if done[row]:
                continue  # the stream pads rows that have stopped
            out[row].append(token)
            if token in eos:
                done[row] = True
            elif row == 0:
                print(tokenizers[0].stream(token), end="", flush=True)
    end = time.perf_counter()
    print()
    prompt_tokens = int(np.sum(lengths))
    decoded = sum(len(r) for r in out) - len(out)
    prefill_tps = prompt_tokens / (first - start)
    decode_tps = decoded / (end - first) if decoded else float("nan")
    if len(prompts) > 1:
        for row, text in enumerate(prompts):
            print(f"\n[{row}] {text}{tokenizers[row].decode(out[row])}")
    print(f"\nprefill: {prompt_tokens} tokens in {first - start:.3f} s ({prefill_tps:,.0f} tokens/s)")
    print(f"decode: {decoded} tokens in {end - first:.3f} s ({decode_tps:,.0f} tokens/s)")
    return {"tokens": out, "prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps, "compile_s": compile_s}


if __name__ == "__main__":
    main()
