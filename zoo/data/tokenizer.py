"""Tokenizers: a checkpoint's ``tokenizer.json`` (through the ``tokenizers`` library) or bytes,
and how a record becomes tokens: plain text (BOS as the checkpoint says, EOS after every
document), prompt/completion pairs and chat conversations rendered with the checkpoint's chat
template, with the loss mask on what the model should learn to write.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from jaxtyping import Bool, Int

from zoo.errors import ConfigError

ROLES = ("system", "user", "assistant")


class DataError(ConfigError):
    """Training or evaluation data that cannot be used: names the file, line or row, and field."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): no BOS, no EOS, no chat template."""

    name = "bytes"
    vocab_size = 256
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos = False
    chat_template: str | None = None
    special_tokens: ClassVar[dict[str, str]] = {}
    fingerprint = "bytes"
    path: Path | None = None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> str:
        return "bytes (vocabulary 256: no tokenizer.json)"


# Texts longer than this (characters) are encoded in pieces of about this size.
LONG_TEXT = 2**20
_LINE_START = re.compile(r"\n(?=\S)")  # where a piece may start: a line that starts with a non-space


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` with the special tokens and chat template of the
    checkpoint's ``tokenizer_config.json`` (and ``generation_config.json``)."""

    def __init__(self, directory: str | Path):
        try:
            import tokenizers
        except ImportError:
            raise ConfigError("reading tokenizer.json needs the `tokenizers` package: pip install tokenizers") from None
        directory = Path(directory)
        self.path = directory / "tokenizer.json"
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 (the library raises a bare Exception)
            raise ConfigError(f"{self.path}: cannot be read by `tokenizers` ({e})") from None
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_id = self._special(config, generation, "bos")
        self.eos_id = self._special(config, generation, "eos")
        add_bos = config.get("add_bos_token")
        if add_bos is None and self.bos_id is not None:  # what the tokenizer.json's post-processor does
            with_special = self.tok.encode("a").ids
            add_bos = bool(with_special) and with_special[0] == self.bos_id and self.tok.encode("a", add_special_tokens=False).ids[:1] != [self.bos_id]  # fmt: skip
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.special_tokens = {
            f"{k}_token": t for k in ("bos", "eos", "pad", "unk") if (t := _token_text(config.get(f"{k}_token")))
        }
        if "eos_token" not in self.special_tokens and self.eos_id is not None:
            self.special_tokens["eos_token"] = self.tok.id_to_token(self.eos_id)
        if "bos_token" not in self.special_tokens and self.bos_id is not None:
            self.special_tokens["bos_token"] = self.tok.id_to_token(self.bos_id)
        self.chat_template, self.chat_template_source = _chat_template(directory, config)
        h = hashlib.sha256()
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            f = directory / name
            h.update(name.encode() + (f.read_bytes() if f.is_file() else b"-"))
        self.fingerprint = h.hexdigest()
        self.name = str(self.path)

    def _special(self, config: dict, generation: dict, kind: str) -> int | None:
        text = _token_text(config.get(f"{kind}_token"))
        if text is not None:
            i = self.tok.token_to_id(text)
            if i is None:
                raise ConfigError(f"{self.path.parent / 'tokenizer_config.json'}: {kind}_token {text!r} is not in {self.path}")
            return i
        i = generation.get(f"{kind}_token_id")
        if isinstance(i, list):
            i = i[0] if i else None
        return i if isinstance(i, int) else None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens (added here by the caller). A text
        over :data:`LONG_TEXT` characters is encoded in pieces, cut only where the tokenizer
        itself cuts (see :meth:`_pieces`): the same ids, in a small fraction of the memory (the
        tokenizers library holds some 200 bytes a token: 10.8 GB for one 50 MB document)."""
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        out = [np.asarray(e.ids, dtype=np.int32) if len(t) <= LONG_TEXT else None
               for t, e in zip(texts, encode([t if len(t) <= LONG_TEXT else "" for t in texts], add_special_tokens=False))]  # fmt: skip
        for i, t in enumerate(texts):
            if out[i] is None:
                pieces = self._pieces(t)
                ids = [np.asarray(e.ids, dtype=np.int32) for k in range(0, len(pieces), 4)
                       for e in encode(pieces[k : k + 4], add_special_tokens=False)]  # fmt: skip
                out[i] = np.concatenate(ids)
        return out

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _pieces(self, text: str) -> list[str]:
        """``text`` cut about every :data:`LONG_TEXT` characters, each cut after a newline that
        a non-space character follows and only where encoding the 512 characters around it
        whole gives the ids of its two halves (the cut is one the tokenizer makes itself: so
        for byte-level BPE with its split pattern; a tokenizer that prefixes each text with a
        space never passes, and its text is encoded whole)."""
        cuts, at = [0], LONG_TEXT
        while at < len(text):
            cut = None
            for tries, m in enumerate(_LINE_START.finditer(text, at, at + 2**16)):
                if tries == 8:
                    break
                n = m.end()
                if self._ids(text[n - 256 : n + 256]) == self._ids(text[n - 256 : n]) + self._ids(text[n : n + 256]):
                    cut = n
                    break
            if cut is None:  # none here: the piece runs on to the next try
                at += LONG_TEXT
                continue
            cuts.append(cut)
            at = cut + LONG_TEXT
        cuts.append(len(text))
        return [text[a:b] for a, b in zip(cuts, cuts[1:])]

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        e = self.tok.encode(text, add_special_tokens=False)
        return np.asarray(e.ids, dtype=np.int32), e.offsets

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> str:
        bos = f"BOS {self.bos_id}" if self.add_bos else "no BOS"
        eos = (f"EOS {self.eos_id} after each text and completion; chats end as their template renders them"
               if self.eos_id is not None else "no EOS")  # fmt: skip
        return f"{self.path} (vocabulary {self.vocab_size}; {bos}; {eos})"


def _chat_template(directory: Path, config: dict) -> tuple[str | None, str]:
    """The chat template, and where it is (a file, and its field), as transformers finds it."""
    template = config.get("chat_template")
    where = f"{directory / 'tokenizer_config.json'}'s chat_template"
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        where += " (the one named default)"
    if isinstance(template, str):
        return template, where
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(), str(directory / "chat_template.jinja")
    jt = _read_json(directory / "chat_template.json").get("chat_template")
    return (jt, f"{directory / 'chat_template.json'}'s chat_template") if isinstance(jt, str) else (None, "")


def load_tokenizer(checkpoint: str | Path | None) -> HFTokenizer | ByteTokenizer:
    """The checkpoint's ``tokenizer.json``; bytes without a checkpoint or without that file."""
    if checkpoint is None or not (Path(checkpoint) / "tokenizer.json").is_file():
        return ByteTokenizer()
    return HFTokenizer(checkpoint)


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip


def copy_tokenizer_files(source: str | Path, target: str | Path) -> list[str]:
    """Copy a checkpoint's tokenizer files next to a model saved from it (``save_pretrained``
    writes the model only), so the saved checkpoint tokenizes as the original did."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(target) / name)
            copied.append(name)
    return copied


def check_vocabulary(tokenizer: HFTokenizer | ByteTokenizer, vocab_size: int) -> None:
    """A tokenizer whose ids reach past the model's embedding table is an error naming both."""
    if tokenizer.vocab_size > vocab_size:
        where = tokenizer.path or "the byte-level tokenizer"
        raise ConfigError(
            f"{where}: the tokenizer's ids go up to {tokenizer.vocab_size - 1} (vocabulary {tokenizer.vocab_size}) "
            f"but the model's vocab_size is {vocab_size} (config.json): a token past the embedding table"
        )


class TextStream:
    """The text of token ids arriving one at a time, a piece per token (what a generation loop
    prints as it goes). ``decode`` turns ids into text (a tokenizer's ``decode``). The ids so far
    are decoded whole each time, which keeps right the characters a token ends halfway through
    and the spaces a tokenizer puts between tokens; while the text ends in an unfinished
    character (U+FFFD), nothing is shown until a later token completes it."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.shown = ""

    def add(self, token: int) -> str:
        """The text ``token`` adds to what was shown (``""`` while a character is unfinished)."""
        self.tokens.append(int(token))
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):  # an unfinished character: wait for the next token
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new


# --- chat templates, rendered as transformers renders them ---------------------------------


def _compile_template(template: str):
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat templates need the `jinja2` package: pip install jinja2") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class ChatEncoder:
    """Renders conversations with a checkpoint's chat template and marks the assistant's tokens."""

    def __init__(self, tokenizer: HFTokenizer | ByteTokenizer):
        if not isinstance(tokenizer, HFTokenizer) or tokenizer.chat_template is None:
            where = tokenizer.path.parent if tokenizer.path is not None else "the byte-level tokenizer (no checkpoint)"
            raise DataError(
                f"chat data needs a chat template, and {where} has none (looked for tokenizer_config.json's "
                "chat_template, chat_template.jinja and chat_template.json)"
            )
        self.tokenizer = tokenizer
        self.source = tokenizer.chat_template_source
        import jinja2

        try:
            self.template = _compile_template(tokenizer.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise DataError(f"the chat template in {self.source} does not parse: line {e.lineno}: {e.message}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.tokenizer.special_tokens
            )
        except jinja2.exceptions.TemplateError as e:  # raise_exception(...) in the template, an undefined name
            raise DataError(f"the chat template in {self.source} failed: {e}") from None
        except Exception as e:  # noqa: BLE001  (a template's own mistakes: adding a string to a number ...)
            raise DataError(f"the chat template in {self.source} failed: {type(e).__name__}: {e}") from None

    def spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Character spans of ``text`` (the whole conversation rendered) that the model learns:
        each assistant message from its first character through the template's end-of-turn
        markup (trailing whitespace excluded). Found by rendering the conversation up to the
        message with the generation prompt (where the reply starts) and through it (where the
        turn ends); for a template that rewrites earlier turns, the message's content itself."""
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            try:
                before = self.render(messages[:i], add_generation_prompt=True)
                through = self.render(messages[: i + 1])
            except DataError:  # a template that refuses a partial conversation
                before = through = None
            if before is not None and text.startswith(through) and through.startswith(before) and len(before) >= cursor:
                start, end = len(before), len(through.rstrip())
            else:
                content = m["content"]
                start = text.find(content, cursor)
                if start < 0 and content.strip():
                    content = content.strip()
                    start = text.find(content, cursor)
                if start < 0:
                    raise DataError(f"message {i}: the assistant's content is not in the rendered conversation")
                end = start + len(content)
            spans.append((start, end))
            cursor = end
        return spans

    def encode(self, messages: list[dict]) -> tuple[Int[np.ndarray, " T"], Bool[np.ndarray, " T"], int]:
        """Tokens of the rendered conversation, the mask of the assistant's tokens (a token
        counts when it starts inside an assistant span) and the UTF-8 bytes of those spans."""
        text = self.render(messages)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        starts = np.array([o[0] for o in offsets], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        nbytes = 0
        for a, b in self.spans(messages, text):
            mask |= (starts >= a) & (starts < b)
            nbytes += len(text[a:b].encode("utf-8"))
        return ids.astype(np.int32), mask, nbytes
