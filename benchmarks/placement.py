"""Memory and speed of every activation-placement preset, as one markdown table.

    python benchmarks/placement.py [--model llama|deepseek_v3] [--platform cpu|gpu] [--budget-gib 1.0]
                                   [--host-budget-gib G] [--steps 3] [--max-batch 256]

For each preset of the model's placement map (and ``none``: no ``jax.checkpoint``), on the
model's bench shape (Llama: ``zoo.llama.preset("bench")``, DeepSeek-V3:
``zoo.deepseek_v3.preset("bench")``, both batch 4 x seq 256), one training step (loss and
gradients) is compiled ahead of time and reported:

- device temp / host temp: ``memory_analysis()`` temp bytes in device and host memory;
- offloaded (map): bytes of the residuals the map sends to pinned host memory (each named
  tensor placed ``pinned_host`` times the layers of every scan holding it), computed from the
  traced shapes, whatever the platform;
- step: median wall time of ``--steps`` steps after one warm-up;
- planner: the step time ``zoo.plan.price`` predicts for the map on this device's entry in the
  planner's hardware table (FLOPs at the table's matmul peak, recomputation, host transfers
  overlapped up to the host link), and measured over predicted: on a GPU, the cost model's
  calibration;
- max batch: the largest batch (same sequence length) whose compiled step fits the device
  budget (arguments + outputs + temps - aliased), by AOT compiles and binary search; with
  ``--host-budget-gib`` the host temp must fit that too.

On CPU, device and pinned host memory are the same RAM: XLA:CPU keeps offloaded residuals
among the device temps and reports no host temps, so offloading shows only in the
``offloaded (map)`` column there. On GPU the flags below are set before JAX starts.

Another model joins with one entry in ``MODELS`` (its config preset, map class and shape).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Let XLA overlap the offload copies (async host<->device transfers) with compute, and let
# its own rematerialisation pass treat pinned-host buffers as host memory (it otherwise
# counts them against the device limit) and offload too.
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_gpu_enable_host_memory_offloading=true")

GiB = 2**30


@dataclass(frozen=True)
class Bench:
    """What the benchmark needs from a model: a fresh model, its map class and its shape."""

    build: Callable[[], tuple[Callable[[Any], Any], type]]  # -> (make_model(key), map class)
    batch: int
    seq: int


def _family(model_type: str) -> Callable[[], tuple[Callable[[Any], Any], type]]:
    """Any registered model type at its ``bench`` preset, with its family's placement map."""

    def build() -> tuple[Callable[[Any], Any], type]:
        from zoo.core import registry

        cls = registry.by_model_type(model_type)
        config = cls.config_cls.preset("bench", model_type)
        return (lambda key: cls(config, key=key)), cls.placement_map

    return build


# The model types this benchmark knows (every registered one; kept as a literal so --help needs no JAX).
MODELS: dict[str, Bench] = {t: Bench(_family(t), batch=4, seq=256) for t in ("llama", "deepseek_v3", "qwen3", "qwen3_moe")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=sorted(MODELS))
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--budget-gib", type=float, default=1.0, help="device memory budget for the max-batch search")
    p.add_argument("--host-budget-gib", type=float, default=None, help="also require host temp bytes under this")
    p.add_argument("--steps", type=int, default=3, help="timed steps per preset (after one warm-up)")
    p.add_argument("--max-batch", type=int, default=256, help="upper end of the max-batch search")
    p.add_argument("--presets", default=None, help="comma-separated subset (default: none + every preset)")
    return p.parse_args(argv)


def setup_platform(platform: str) -> None:
    """Environment for JAX, which must not be imported yet, and the host allocator settings."""
    if "jax" in sys.modules:
        raise RuntimeError("setup_platform must run before jax is imported")
    if platform == "gpu":
        os.environ["JAX_PLATFORMS"] = "cuda"
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = " ".join([flags, *GPU_XLA_FLAGS]).strip()
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
    from zoo.runtime import retain_host_memory

    retain_host_memory()  # no page faults on every step's temporaries (see zoo/runtime.py)


def known_compile_options(options: dict) -> dict:
    """The subset of ``options`` the installed XLA knows (newer XLA dropped the fusion-emitter switch)."""
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(lambda x: x + 1).lower(jnp.zeros(2))
    known = {}
    for name, value in options.items():
        try:
            lowered.compile({name: value})
        except Exception:  # noqa: BLE001  (XLA: no such compile option)
            continue
        known[name] = value
    return known


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_platform(args.platform)

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import zoo
    from zoo.placement import subjaxprs

    bench = MODELS[args.model]
    make_model, map_cls = bench.build()
    # On CPU the buffers barely depend on LLVM's optimisation or the fusion emitters (a few
    # hundred bytes): compile the search ~5x faster without them.
    search_options = known_compile_options({"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}) if args.platform == "cpu" else None

    names = ["none", *map_cls.preset_names()] if args.presets is None else args.presets.split(",")
    placements = {n: None if n == "none" else map_cls.parse(n) for n in names}
    model = make_model(jax.random.key(0))
    abstract = jax.eval_shape(lambda: model)
    num_layers = model.config.num_layers
    ids_of = lambda b: jax.ShapeDtypeStruct((b, bench.seq), jnp.int32)  # noqa: E731

    def named_bytes(fn, *args) -> dict[str, int]:
        """Bytes each checkpoint_name stands for in the backward pass: its size times the
        layers of the scan holding it (once outside a scan), summed over its occurrences."""
        out: dict[str, int] = {}

        def walk(jaxpr, layers: int) -> None:
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "name":
                    aval = eqn.outvars[0].aval
                    size = int(np.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize
                    out[eqn.params["name"]] = out.get(eqn.params["name"], 0) + layers * size
                inner = layers * eqn.params["length"] if eqn.primitive.name == "scan" else layers
                for sub in subjaxprs(eqn):
                    walk(sub, inner)

        walk(jax.make_jaxpr(fn)(*args).jaxpr, 1)
        return out

    ids0 = jnp.zeros((bench.batch, bench.seq), jnp.int32)
    sizes = named_bytes(lambda m: zoo.lm_loss(m, ids0, placement="device"), model)

    def step_fn(placement):
        return jax.jit(lambda m, ids: eqx.filter_value_and_grad(zoo.lm_loss)(m, ids, placement=placement))

    def device_bytes(stats) -> int:
        used = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
        return used - stats.alias_size_in_bytes

    def fits(placement, batch: int) -> bool:
        stats = step_fn(placement).lower(abstract, ids_of(batch)).compile(search_options).memory_analysis()
        ok = device_bytes(stats) <= args.budget_gib * GiB
        if args.host_budget_gib is not None:
            ok = ok and stats.host_temp_size_in_bytes <= args.host_budget_gib * GiB
        return ok

    def max_batch(placement) -> str:
        if not fits(placement, 1):
            return "0"
        good, bad = 1, None
        while bad is None:
            trial = min(good * 2, args.max_batch)
            if trial == good:
                return f">={good}"
            if fits(placement, trial):
                good = trial
            else:
                bad = trial
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(placement, mid) else (good, mid)
        return str(good)

    # The planner's predicted step time of each map on this device's entry in zoo.plan's
    # hardware table, beside the measured one: the first GPU run calibrates its cost model.
    from zoo.plan import price
    from zoo.hardware import for_device

    hw = for_device(jax.devices()[0])
    predicted: dict[str, float] = {}
    if hw is not None:
        for c in price(abstract, placements, seq_len=bench.seq, batch_size=bench.batch, hardware=hw):
            predicted[c.label] = c.step_time

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, model.config.vocab_size, (bench.batch, bench.seq)), jnp.int32)
    rows = []
    for name, placement in placements.items():
        step = step_fn(placement)
        compiled = step.lower(model, ids).compile()
        stats = compiled.memory_analysis()
        offloaded = 0 if placement is None else sum(sizes[n] for n in placement.placed("pinned_host"))
        jax.block_until_ready(compiled(model, ids))
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(model, ids))
            times.append(time.perf_counter() - t0)
        rows.append(
            (
                name,
                fmt_bytes(stats.temp_size_in_bytes),
                fmt_bytes(stats.host_temp_size_in_bytes),
                fmt_bytes(offloaded),
                f"{1000 * statistics.median(times):.0f}",
                f"{1000 * predicted[name]:.0f}" if name in predicted else "-",
                f"{statistics.median(times) / predicted[name]:.2f}" if name in predicted else "-",
                max_batch(placement),
            )
        )
        print(f"  {name}: done", file=sys.stderr, flush=True)

    device = jax.devices()[0]
    host = "" if args.host_budget_gib is None else f", host budget {args.host_budget_gib:g} GiB"
    print(
        f"{args.model} bench shape (batch {bench.batch} x seq {bench.seq}, {num_layers} layers), "
        f"loss + gradients, {device.platform} ({device.device_kind}); "
        f"max batch under {args.budget_gib:g} GiB device{host}\n"
    )
    budget = f"max batch @ {args.budget_gib:g} GiB"
    planner = f"planner ms ({hw})" if hw else "planner ms (device not in zoo.plan's table)"
    header = ("placement", "device temp", "host temp", "offloaded (map)", "step ms", planner, "measured / planner", budget)
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
