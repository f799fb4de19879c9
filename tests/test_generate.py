"""Generation: prefill + cached decode equal the full forward pass at every position (ragged
prompts included), the MLA cache holds only the latent and the rope key, absorbed decoding
equals the expanded computation, and the sampling / stopping / length rules."""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import FIXTURES, reference

import zoo
from zoo import generate as gen
from zoo.deepseek_v3.decode import MLACache, absorbed_attention
from zoo.deepseek_v3.model import mla_expand, mla_project
from zoo.layers import rope_cos_sin
from zoo.params import flatten

LLAMAS = ["llama3_1-tiny", "llama3_1-tiny-tied-mqa", "llama3_1-tiny-mha-rope-parameters"]
DEEPSEEKS = ["deepseek_v3-tiny", "deepseek_v3-tiny-qplain-unnormed", "deepseek_v3-tiny-16e-mtp"]
QWENS = ["qwen3-tiny-tied", "qwen3-tiny-yarn", "qwen3_moe-tiny", "qwen3_moe-tiny-mixed-sharded"]
RAGGED = np.array([7, 12], np.int32)  # prompt lengths of the two reference rows
MAX_LEN = 29  # more slots than the 24 positions used: empty slots must stay invisible

prefill = eqx.filter_jit(gen.prefill)
decode_step = eqx.filter_jit(gen.decode_step)


@functools.cache
def model(name: str):
    return zoo.from_pretrained(FIXTURES / name)


def cached_logits(m, ids: np.ndarray, lengths: np.ndarray, **options) -> tuple[np.ndarray, object]:
    """Logits at every position, from a prefill of the first ``lengths[b]`` tokens of each row
    (right-padded with zeros), then one decode step per later token (teacher forcing)."""
    b, s = ids.shape
    width = int(lengths.max())
    prompt = np.where(np.arange(width) < lengths[:, None], ids[:, :width], 0).astype(np.int32)
    logits, cache = prefill(m, jnp.asarray(prompt), jnp.asarray(lengths), max_len=MAX_LEN, all_logits=True, **options)
    out = np.full((b, s, m.config.vocab_size), np.nan, np.float32)
    for row in range(b):
        out[row, : lengths[row]] = np.asarray(logits[row, : lengths[row]])
    for i in range(s - int(lengths.min())):
        pos = lengths + i
        tokens = np.where(pos < s, ids[np.arange(b), np.minimum(pos, s - 1)], 0).astype(np.int32)
        step, cache = decode_step(m, cache, jnp.asarray(tokens))
        for row in np.flatnonzero(pos < s):
            out[row, pos[row]] = np.asarray(step[row])
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + s - int(lengths.min()))
    return out, cache


def check_against_forward(name: str, lengths: np.ndarray, **options) -> None:
    ref = reference(name)
    ids = ref["input_ids"].astype(np.int32)
    logits, _ = cached_logits(model(name), ids, lengths, **options)
    assert not np.isnan(logits).any()  # every position was produced by prefill or decode
    for row in range(ids.shape[0]):
        for pos in range(ids.shape[1]):
            np.testing.assert_allclose(
                logits[row, pos], ref["logits"][row, pos], atol=1e-5, rtol=0,
                err_msg=f"{name} {options}: row {row} position {pos} (prompt length {lengths[row]})",
            )  # fmt: skip


@pytest.mark.parametrize("name", LLAMAS + DEEPSEEKS + QWENS)
def test_prefill_then_decode_equals_the_full_forward_pass(name):
    """Ragged prompts (7 and 12 tokens, zero-padded): prefill logits at the prompt positions,
    decode logits at every later one, against ``transformers``' full forward pass."""
    check_against_forward(name, RAGGED)


@pytest.mark.parametrize("name", ["llama3_1-tiny", "deepseek_v3-tiny"])
def test_equal_length_prompts_and_a_single_token_prompt(name):
    """(Same prompt width as the ragged case, so the compiled programs are reused.)"""
    check_against_forward(name, np.array([12, 12], np.int32))
    check_against_forward(name, np.array([1, 12], np.int32))


@pytest.mark.parametrize("mla", ["reexpand", "expanded"])
def test_reference_mla_decodes_equal_the_forward_pass_too(mla):
    check_against_forward("deepseek_v3-tiny", RAGGED, mla=mla)


def test_absorbed_decode_equals_the_expanded_computation():
    """One layer's attention over a cache with random contents and ragged positions:
    absorption against keys and values expanded through ``kv_b_proj``."""
    m = model("deepseek_v3-tiny")
    config, p = m.config, jax.tree.map(lambda w: w[0], m.moe_layers.attn)
    k1, k2, k3, k4 = jr.split(jr.key(0), 4)
    b, t = 3, 11
    h = jr.normal(k1, (b, 1, config.hidden_size))
    positions = jnp.array([[0], [5], [10]], jnp.int32)
    cos, sin = rope_cos_sin(config.rope, config.qk_rope_head_dim, positions)
    latent = jr.normal(k2, (b, t, config.kv_lora_rank))
    k_rope = jr.normal(k3, (b, t, config.qk_rope_head_dim))

    @jax.jit
    def both(p, h, latent, k_rope):
        q, _, _ = mla_project(config, p, h, cos, sin)
        k, v = mla_expand(config, p, latent, k_rope)  # [B, T, H, *]; a cache keeps heads first
        expanded = gen.cached_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), positions, scale=config.softmax_scale)
        return absorbed_attention(config, p, q, latent, k_rope, positions), expanded

    absorbed, expanded = both(p, h, latent, k_rope)
    assert absorbed.shape == (b, 1, config.num_heads, config.v_head_dim)
    np.testing.assert_allclose(np.asarray(absorbed), np.asarray(expanded), atol=1e-5, rtol=1e-5)
    # Changing slot 1 changes nothing for the row at position 0, and the rows past it.
    later, _ = both(p, h, latent.at[:, 1].add(jr.normal(k4, (config.kv_lora_rank,))), k_rope)
    np.testing.assert_array_equal(np.asarray(later[0]), np.asarray(absorbed[0]))
    assert not np.allclose(np.asarray(later[1:]), np.asarray(absorbed[1:]), atol=1e-3)


def test_mla_cache_holds_only_the_latent_and_the_rope_key():
    bench = zoo.deepseek_v3.preset("bench")
    models = {
        "deepseek_v3-tiny": model("deepseek_v3-tiny"),
        "bench": eqx.filter_eval_shape(lambda: zoo.DeepseekV3(bench, key=jr.key(0), compute_dtype=jnp.bfloat16)),
    }
    for m in models.values():
        config = m.config
        cache = eqx.filter_eval_shape(gen.init_cache, m, 2, 40)
        itemsize = jnp.dtype(m.compute_dtype).itemsize
        c, p, L = config.kv_lora_rank, config.qk_rope_head_dim, config.num_layers
        assert isinstance(cache, MLACache) and cache.absorb
        assert cache.latent.shape == (L, 2, 40, c) and cache.k_rope.shape == (L, 2, 40, p)
        assert [x.shape for x in jax.tree.leaves(cache)] == [(L, 2, 40, c), (L, 2, 40, p), (2,)]
        assert cache.bytes_per_token == L * (c + p) * itemsize
        expanded = eqx.filter_eval_shape(gen.init_cache, m, 2, 40, mla="expanded")
        h, k, u = config.num_heads, config.qk_head_dim, config.v_head_dim
        assert expanded.bytes_per_token == L * h * (k + u) * itemsize
    assert cache.bytes_per_token == 4 * (64 + 32) * 2  # the bench shape in bf16: 768 B per token
    llama = model("llama3_1-tiny")
    kv = eqx.filter_eval_shape(gen.init_cache, llama, 2, 40)
    assert kv.bytes_per_token == 2 * llama.config.num_layers * llama.config.num_kv_heads * llama.config.head_dim * 4


@pytest.mark.parametrize("name", ["llama3_1-tiny", "deepseek_v3-tiny", "qwen3_moe-tiny"])
def test_families_declare_the_cache_options_they_take(name):
    """What recipes offer as flags (recipes/generate.py's --mla): a family's declared cache
    options, each choice one its init_cache takes; a family declaring none refuses any."""
    m = model(name)
    for option, (choices, text) in type(m).cache_options.items():
        assert choices and text
        for choice in choices:
            eqx.filter_eval_shape(gen.init_cache, m, 2, 8, **{option: choice})
    assert bool(type(m).cache_options) == isinstance(m, zoo.DeepseekV3)
    if not type(m).cache_options:
        with pytest.raises(ValueError, match=f"{type(m).__name__} takes no cache options, got mla='absorbed'"):
            eqx.filter_eval_shape(gen.init_cache, m, 2, 8, mla="absorbed")


def _context_sized(mla: str, t: int = 37, b: int = 3) -> list[tuple[int, ...]]:
    """Shapes in the decode step's program holding, per head, something per cached slot."""
    m = model("deepseek_v3-tiny")
    config = m.config
    cache = gen.init_cache(m, b, t, mla=mla)
    jaxpr = jax.make_jaxpr(lambda m, c, x: gen.decode_step(m, c, x))(m, cache, jnp.zeros((b,), jnp.int32))
    per_head = {config.qk_nope_head_dim, config.v_head_dim, config.qk_head_dim, config.qk_nope_head_dim + config.v_head_dim}
    found = []

    def walk(j):
        for eqn in j.eqns:
            for var in eqn.outvars:
                shape = getattr(var.aval, "shape", ())
                if t in shape and config.num_heads in shape and per_head & set(shape):
                    found.append(shape)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return found


def test_absorbed_decode_never_expands_keys_or_values_for_the_context():
    """No array in the absorbed decode step has a per-head key or value for every cached slot;
    the re-expanding reference (MaxText's, jax-llm-examples') has them."""
    assert _context_sized("absorbed") == []
    assert (3, 37, 4, 32) in _context_sized("reexpand")  # latent @ kv_b_proj over all 37 slots


# -- generation ---------------------------------------------------------------------------------

PROMPTS = [[72, 101, 108, 108, 111], [84, 104, 101, 32, 113, 117, 105, 99, 107]]  # ragged: 5 and 9 tokens


@functools.cache
def greedy(name: str = "llama3_1-tiny", new: int = 8):
    ids, lengths = gen.pad_prompts(PROMPTS)
    return gen.generate(model(name), ids, lengths, max_new_tokens=new, eos_token_id=())


@pytest.mark.parametrize("name", ["llama3_1-tiny", "deepseek_v3-tiny"])
def test_greedy_tokens_are_the_argmax_of_the_full_forward_pass(name):
    out = greedy(name)
    assert out.tokens.shape == (2, 8) and np.asarray(out.num_tokens).tolist() == [8, 8]
    rows = [p + np.asarray(out.tokens[i]).tolist() for i, p in enumerate(PROMPTS)]
    ids, _ = gen.pad_prompts(rows)
    logits = np.asarray(eqx.filter_jit(lambda m, x: m(x))(model(name), ids))
    for i, p in enumerate(PROMPTS):
        predicted = logits[i, len(p) - 1 : len(p) + 7].argmax(-1)
        np.testing.assert_array_equal(predicted, np.asarray(out.tokens[i]), err_msg=f"{name} row {i}")


def test_stream_yields_what_generate_returns_when_sampling():
    ids, lengths = gen.pad_prompts(PROMPTS)
    kw = {"max_new_tokens": 8, "key": jr.key(3), "temperature": 1.5, "top_k": 50, "top_p": 0.95, "eos_token_id": ()}
    out = gen.generate(model("llama3_1-tiny"), ids, lengths, **kw)
    steps = list(gen.stream(model("llama3_1-tiny"), ids, lengths, **kw))
    np.testing.assert_array_equal(np.stack(steps, axis=1), np.asarray(out.tokens))
    assert not np.array_equal(np.asarray(out.tokens), np.asarray(greedy().tokens))  # it did sample
    again = gen.generate(model("llama3_1-tiny"), ids, lengths, **kw)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(out.tokens))  # and reproducibly


def test_rows_stop_at_their_end_of_sequence_token():
    ids, lengths = gen.pad_prompts(PROMPTS)
    ref = np.asarray(greedy().tokens)
    eos = int(ref[0, 2])  # row 0's third token
    stop = [int(np.flatnonzero(r == eos)[0]) + 1 if eos in r else 8 for r in ref]
    out = gen.generate(model("llama3_1-tiny"), ids, lengths, max_new_tokens=8, eos_token_id=eos, pad_id=255)
    assert np.asarray(out.num_tokens).tolist() == stop
    for row, n in enumerate(stop):
        np.testing.assert_array_equal(np.asarray(out.tokens[row, :n]), ref[row, :n])
        assert (np.asarray(out.tokens[row, n:]) == 255).all()
    steps = list(gen.stream(model("llama3_1-tiny"), ids, lengths, max_new_tokens=8, eos_token_id=eos, pad_id=255))
    assert len(steps) == max(stop)  # stops once every row has stopped
    np.testing.assert_array_equal(np.stack(steps, axis=1), np.asarray(out.tokens[:, : max(stop)]))


def test_end_of_sequence_ids_come_from_generation_config(tmp_path):
    assert gen.eos_token_ids(FIXTURES / "llama3_1-tiny") == (2,)
    assert gen.eos_token_ids(model("deepseek_v3-tiny")) == (1,)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert gen.eos_token_ids(tmp_path) == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert gen.eos_token_ids(tmp_path) == (128001, 128009)
    assert gen.eos_token_ids(None) == () and gen.eos_token_ids([3, 4]) == (3, 4)
    with pytest.raises(ValueError, match=r"non-negative integers, got \[-1\]"):
        gen.eos_token_ids([-1])
    with pytest.raises(ValueError, match="nowhere: not a checkpoint directory"):
        gen.eos_token_ids(tmp_path / "nowhere")


def test_length_past_the_models_positions_is_refused_naming_the_numbers():
    m = model("llama3_1-tiny")
    short = zoo.Llama(dataclasses.replace(m.config, max_position_embeddings=16), arrays=flatten(m))
    ids, lengths = gen.pad_prompts(PROMPTS)
    msg = r"prompt length 9 \+ max_new_tokens 8 = 17 tokens exceeds the model's max_position_embeddings 16"
    with pytest.raises(ValueError, match=msg):
        gen.generate(short, ids, lengths, max_new_tokens=8)
    with pytest.raises(ValueError, match=msg):
        next(gen.stream(short, ids, lengths, max_new_tokens=8))
    with pytest.raises(ValueError, match=r"lengths must be in 1\.\.9 \(the padded prompt width\), got \[5, 10\]"):
        gen.generate(m, ids, [5, 10], max_new_tokens=2)
    with pytest.raises(ValueError, match="the prompts are 9 positions wide but the cache has max_len=4"):
        gen.prefill(m, ids, lengths, max_len=4)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        gen.generate(m, ids, lengths, max_new_tokens=2, temperature=0.7)
    with pytest.raises(ValueError, match="Llama takes no cache options, got mla='expanded'"):
        gen.generate(m, ids, lengths, max_new_tokens=2, mla="expanded")


# -- sampling -----------------------------------------------------------------------------------


@jax.jit
def _draws(logits, keys, settings: gen.Sampling):
    kw = {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p}
    return jax.vmap(lambda k: gen.sample(logits, k, **kw))(keys)[:, 0]


def draws(logits, **kw) -> np.ndarray:
    """4000 samples; one compiled program for every setting (they are traced arrays)."""
    return np.asarray(_draws(logits, jr.split(jr.key(0), 4000), gen.Sampling.of(**kw)))


def test_sampling_rules():
    probs = jnp.array([[0.05, 0.5, 0.1, 0.3, 0.05]])
    logits = jnp.log(probs)
    assert int(gen.sample(logits, None)[0]) == 1  # greedy
    assert set(draws(logits, temperature=0.0)) == {1}  # greedy with traced settings
    for kw in ({"top_k": 1}, {"top_p": 0.2}):
        assert set(draws(logits, temperature=5.0, **kw)) == {1}
    two = draws(logits, top_k=2, temperature=1.0)
    assert set(two) == {1, 3}
    # Sample frequencies over 4000 fixed-seed draws: one standard error is at most 0.008, so
    # atol=0.03 is ~4 sigma, while a wrong rule (e.g. no renormalisation) moves them by >= 0.1.
    np.testing.assert_allclose((two == 1).mean(), 0.5 / 0.8, atol=0.03)
    nucleus = draws(logits, top_p=0.85, temperature=1.0)  # 0.5 + 0.3 < 0.85: the 0.1 is needed too
    assert set(nucleus) == {1, 2, 3}
    np.testing.assert_allclose([(nucleus == i).mean() for i in (1, 2, 3)], [0.5 / 0.9, 0.1 / 0.9, 0.3 / 0.9], atol=0.03)
    everything = draws(logits, temperature=1.0)
    np.testing.assert_allclose(np.bincount(everything, minlength=5) / 4000, probs[0], atol=0.03)
    hot = draws(logits, temperature=100.0)
    assert np.bincount(hot, minlength=5).min() > 600  # near uniform


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"temperature": 1.0, "top_k": 0}, "top_k must be a positive integer or None, got 0"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\] or None, got 1.5"),
    ],
)
def test_bad_sampling_settings_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        gen.sample(jnp.zeros((1, 4)), jr.key(0), **kw)


# -- the recipe ---------------------------------------------------------------------------------


def recipe():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_recipe", FIXTURES.parents[1] / "recipes" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_streams_with_the_checkpoints_tokenizer(tmp_path, monkeypatch, capsys):
    """A checkpoint with a tokenizer.json is tokenized through the `tokenizers` library (a
    stand-in here, byte-level, so the tokens are checkable), imported only then."""
    import sys
    import types

    for f in ("config.json", "generation_config.json", "model.safetensors"):
        (tmp_path / f).symlink_to(FIXTURES / "llama3_1-tiny" / f)
    (tmp_path / "tokenizer.json").write_text("{}")
    opened = []

    class Tokenizer:
        @staticmethod
        def from_file(path):
            opened.append(path)
            return Tokenizer()

        def encode(self, text):
            return types.SimpleNamespace(ids=list(text.encode()))

        def decode(self, ids):
            return bytes(ids).decode(errors="replace")

    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=Tokenizer))
    args = [str(tmp_path), "--prompt", "Hello", "--prompt", "The quick", "--max-new-tokens", "8", "--ignore-eos"]
    result = recipe().main(args)
    assert opened == [str(tmp_path / "tokenizer.json")] * 2
    assert result["tokens"] == np.asarray(greedy().tokens).tolist()  # the prompts of PROMPTS, greedily
    out = capsys.readouterr().out
    assert "Hello" + bytes(result["tokens"][0]).decode(errors="replace") in out  # streamed
    assert "tokenizer.json tokens, end of sequence off" in out
    assert "prefill: 14 tokens in" in out and "decode: 14 tokens in" in out and "tokens/s" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
        (["--top-k", "0"], "--top-k: must be >= 1, got 0"),
        (["--max-new-tokens", "many"], "--max-new-tokens: expected a whole number >= 1, got 'many'"),
        (["--eos", "2,x"], "--eos takes token ids separated by commas, got '2,x'"),
        (["--eos", "2", "--ignore-eos"], "not allowed with argument --eos"),
        (["--mla", "fast"], "invalid choice: 'fast'"),
        (["--mla", "absorbed"], "Llama takes no cache options, got mla='absorbed'"),
        (["/nowhere"], "/nowhere is not a checkpoint directory"),
        (["--max-new-tokens", "200000"], "prompt length 19 \\+ max_new_tokens 200000 = 200019 tokens exceeds"),
    ],
)
def test_recipe_flags_are_documented_and_checked(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        recipe().main(["--help"])
    assert e.value.code == 0
    shown = capsys.readouterr().out
    assert all(f in shown for f in ("--max-new-tokens", "--top-p", "--eos", "--ignore-eos", "tokenizer.json"))
    with pytest.raises(SystemExit) as e:
        recipe().main(args)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("name", ["llama3_1-tiny", "deepseek_v3-tiny", "qwen3_moe-tiny"])
def test_every_entry_point_takes_lengths_none_as_full_rows(name):
    """``prefill``, ``generate`` and ``stream`` take the same optional ``lengths``: ``None``
    means every row is full (prefill without lengths raised AttributeError in the cache)."""
    m = model(name)
    ids = jnp.asarray(reference(name)["input_ids"][:, :9])
    full = jnp.full((ids.shape[0],), ids.shape[1], jnp.int32)
    logits, cache = gen.prefill(m, ids, None, max_len=16)
    want, want_cache = gen.prefill(m, ids, full, max_len=16)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(want_cache.lengths))
    logits, _ = gen.prefill(m, ids, max_len=16)  # omitted altogether
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
    out = gen.generate(m, ids, None, max_new_tokens=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(gen.generate(m, ids, full, max_new_tokens=3).tokens))
    streamed = np.stack([np.asarray(t) for t in gen.stream(m, ids, None, max_new_tokens=3)], axis=1)
    np.testing.assert_array_equal(streamed, np.asarray(out.tokens))
