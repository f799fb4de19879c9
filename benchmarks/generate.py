"""Decode speed and cache size: Llama's grouped-query cache, DeepSeek-V3's compressed MLA cache
decoded by weight absorption, the same cache re-expanded every step (what MaxText and
jax-llm-examples do), and an expanded per-head cache.

    python benchmarks/generate.py [--batch 4] [--context 1024] [--steps 16] [--dtype float32]

Models are the shared bench shapes (``preset("bench")``) with random weights. Each decode
starts from a cache holding ``--context`` tokens per row (random contents; the DeepSeek-V3
caches hold the same numbers: the expanded one is the compressed one put through
``kv_b_proj``, and the three give the same logits, checked before timing), then runs
``--steps`` greedy decode steps in one compiled loop. Prints one markdown table: cache
bytes per token (all layers), decode tokens/s (batch x steps over the fastest of
``--repeats`` runs), and for DeepSeek-V3 both as ratios to the expanded cache's.
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import zoo
from zoo import generate as gen
from zoo.deepseek_v3.model import mla_expand


def random_cache(model, batch: int, context: int, max_len: int, mla: str, key) -> gen.Cache:
    """A cache of random numbers holding ``context`` tokens per row; the expanded DeepSeek-V3
    cache is the compressed one (same key) put through ``kv_b_proj``."""
    cache = gen.init_cache(model, batch, max_len, mla="absorbed" if mla == "reexpand" else mla)
    lengths = jnp.full((batch,), context, jnp.int32)
    if isinstance(model, zoo.DeepseekV3) and mla != "absorbed":
        source = random_cache(model, batch, context, max_len, "absorbed", key)
        if mla == "reexpand":
            return gen.MLACache(source.latent, source.k_rope, lengths, absorb=False)
        attn = [s.attn for s in (model.dense_layers, model.moe_layers) if s is not None]
        attn = jax.tree.map(lambda *a: jnp.concatenate(a), *attn)
        k, v = jax.vmap(lambda p, lat, kr: mla_expand(model.config, p, lat, kr))(attn, source.latent, source.k_rope)
        return gen.KVCache(jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3), lengths)  # heads before positions
    rng = np.random.default_rng(key)
    noise = [jnp.asarray(rng.standard_normal(a.shape, np.float32), a.dtype) for a in jax.tree.leaves(cache)[:2]]
    return eqx.tree_at(lambda c: (*jax.tree.leaves(c)[:2], c.lengths), cache, (*noise, lengths))


@eqx.filter_jit
def decode_loop(model, cache, tokens, steps: int):
    """``steps`` greedy decode steps; the last tokens and the first step's logits."""

    def body(i, state):
        cache, tokens, first = state
        logits, cache = gen.decode_step(model, cache, tokens)
        first = jnp.where(i == 0, logits, first)
        return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32), first

    first = jnp.zeros((tokens.shape[0], model.config.vocab_size), jnp.float32)
    return jax.lax.fori_loop(0, steps, body, (cache, tokens, first))[1:]


def random_model(cls, config, dtype, seed: int = 0, **kw):
    """Random weights drawn with NumPy (normal, std 0.02; norms 1, biases 0): no compile."""
    params = zoo.llama.llama_params if cls is zoo.Llama else zoo.deepseek_v3.deepseek_v3_params
    rng = np.random.default_rng(seed)
    arrays = {}
    for path, spec in params(config).items():
        shape = spec.shape(config.sizes)
        if spec.init == "normal":
            value = rng.standard_normal(shape, np.float32) * np.float32(config.initializer_range)
        else:
            value = np.full(shape, 1.0 if spec.init == "ones" else 0.0, np.float32)
        arrays[path] = jnp.asarray(value, dtype)
    return cls(config, arrays=arrays, compute_dtype=dtype, **kw)


def bench(model, name: str, mla: str, args, key) -> dict:
    cache = random_cache(model, args.batch, args.context, args.context + args.steps, mla, key)
    tokens = jnp.asarray(np.random.default_rng(key).integers(0, model.config.vocab_size, args.batch), jnp.int32)
    _, logits = jax.block_until_ready(decode_loop(model, cache, tokens, args.steps))  # compile + warm up
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        jax.block_until_ready(decode_loop(model, cache, tokens, args.steps))
        times.append(time.perf_counter() - t)
    return {
        "model": name,
        "mla": mla,
        "bytes": cache.bytes_per_token,
        "tps": args.batch * args.steps / min(times),
        "logits": np.asarray(logits),
    }


LABELS = {
    ("llama", "absorbed"): ("Llama bench", "grouped-query K + V", "attend over the cache"),
    ("deepseek", "absorbed"): ("DeepSeek-V3 bench", "MLA compressed: latent + rope key", "absorbed (zoo)"),
    ("deepseek", "reexpand"): ("DeepSeek-V3 bench", "MLA compressed: latent + rope key", "re-expand K, V every step"),
    ("deepseek", "expanded"): ("DeepSeek-V3 bench", "expanded per-head K + V", "attend over the cache"),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=1024, help="tokens already in the cache per row")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the fastest counts (shared machines are noisy)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights, compute and cache")
    p.add_argument("--expert-impl", default="auto", help="DeepSeek-V3 expert path (auto, tiled, ragged_dot, dense)")
    a = p.parse_args(argv)
    if min(a.batch, a.context, a.steps, a.repeats) < 1:
        p.error("--batch, --context, --steps and --repeats must be positive")
    dtype = jnp.dtype(a.dtype)
    key = 0
    llama = random_model(zoo.Llama, zoo.llama.preset("bench"), dtype)
    deepseek = random_model(zoo.DeepseekV3, zoo.deepseek_v3.preset("bench"), dtype, expert_impl=a.expert_impl)
    rows = [bench(llama, "llama", "absorbed", a, key)]
    rows += [bench(deepseek, "deepseek", mla, a, key) for mla in ("absorbed", "reexpand", "expanded")]
    # Same numbers first: the three DeepSeek-V3 decodes start from the same cache contents.
    tol = 1e-4 if dtype == jnp.float32 else 5e-2
    for r in rows[2:]:
        np.testing.assert_allclose(r["logits"], rows[1]["logits"], atol=tol, rtol=tol, err_msg=r["mla"])

    print(f"Decode on {jax.devices()[0].device_kind}, {a.dtype}, batch {a.batch}, {a.context} tokens cached per row, "
          f"{a.steps} steps, best of {a.repeats}\n")  # fmt: skip
    absorbed, reexpand, expanded = rows[1:]
    print("| model | cache | decode | cache bytes / token | decode tokens/s | bytes vs expanded | tokens/s vs expanded |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        model, cache, decode = LABELS[r["model"], r["mla"]]
        ratios = "– | –"
        if r["model"] == "deepseek":
            ratios = f"{r['bytes'] / expanded['bytes']:.3f}x | {r['tps'] / expanded['tps']:.2f}x"
        print(f"| {model} | {cache} | {decode} | {r['bytes']:,} | {r['tps']:,.0f} | {ratios} |")
    print(f"\nMLA compressed vs expanded cache: {expanded['bytes'] / absorbed['bytes']:.1f}x fewer bytes per token; "
          f"absorbed decode {absorbed['tps'] / expanded['tps']:.2f}x the tokens/s of the expanded cache and "
          f"{absorbed['tps'] / reexpand['tps']:.2f}x those of re-expanding the compressed one.")  # fmt: skip


if __name__ == "__main__":
    main()
