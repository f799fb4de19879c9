"""The planner's estimate against XLA:CPU's memory_analysis over the wider grid of docs/planning.md.

    python benchmarks/planner_grid.py            # 8 simulated CPU devices; prints the markdown table

Each row compiles the whole training step (the `small` presets) on one device or an 8-device
mesh and compares `zoo.plan.estimate` of the same traced program (counted as XLA:CPU counts:
one memory) with the compiled step's arguments + outputs + temporaries - aliases. On the FSDP
meshes the embedding and head are streamed (zoo/vocab_parallel.py), not gathered whole.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from zoo import plan  # noqa: E402
from zoo.core import registry

# (family, mesh, map, parameters, optimizer state, batch, tokens, expert kernel)
GRID = [
    ("llama", "data=2,fsdp=4", "offload_attn", "device", "pinned_host", 8, 128, None),
    ("qwen3", None, None, "device", "device", 4, 128, None),
    ("qwen3", "fsdp=4,tensor=2", "offload_mlp", "pinned_host", "pinned_host", 8, 128, None),
    ("deepseek_v3", None, "nvidia_offload", "pinned_host", "device", 2, 128, None),
    ("deepseek_v3", "fsdp=8", "remat", "device", "device", 8, 64, None),
    ("deepseek_v3", "fsdp=4,tensor=2", "remat", "device", "device", 8, 64, None),
    ("deepseek_v3", "fsdp=2,expert=4", "remat", "device", "device", 8, 64, None),
    ("deepseek_v3", "data=2,expert=4", "remat", "device", "device", 8, 64, None),
    ("deepseek_v3", "expert=8", "save_matmuls", "device", "device", 8, 64, None),
    ("qwen3_moe", None, "remat", "device", "device", 2, 128, None),
    ("qwen3_moe", "fsdp=8", "remat", "device", "device", 8, 64, None),
    ("qwen3_moe", "fsdp=8", "remat", "device", "device", 8, 64, "grouped"),
    ("qwen3_moe", "fsdp=8", "offload_mlp", "device", "pinned_host", 8, 64, None),
    ("qwen3_moe", "data=2,fsdp=4", "remat", "device", "device", 8, 64, None),
    ("qwen3_moe", "fsdp=4,tensor=2", "remat", "device", "device", 8, 64, None),
    ("qwen3_moe", "fsdp=2,expert=4", "remat", "device", "device", 8, 64, None),
    ("qwen3_moe", "data=2,expert=2,tensor=2", "device", "device", "device", 8, 64, None),
]


def subject(family: str, kernel: str | None):
    cls = registry.by_model_type(family)
    config = cls.config_cls.preset("small", family)
    if kernel is None:
        return config
    return cls(config, key=jax.random.key(0)).with_expert_impl(kernel)


def compiler_options() -> dict:
    """The suite's fast compile (LLVM -O0, the classic fusion emitters), each option where the
    installed XLA has it: the grid in docs/planning.md was measured so."""
    x = jax.ShapeDtypeStruct((2,), jax.numpy.float32)
    lowered = jax.jit(lambda v: v + 1).lower(x)
    out = {}
    for name, value in (("xla_backend_optimization_level", 0), ("xla_cpu_use_fusion_emitters", False)):
        try:
            lowered.compile({**out, name: value})
            out[name] = value
        except Exception:  # noqa: BLE001  (an option this XLA does not know)
            pass
    return out


def main() -> None:
    only = sys.argv[1:]
    worst, options = [], compiler_options()
    print(f"compile options: {options}\n")
    print("| family | mesh | map | parameters/optimizer | batch x tokens | estimate MB | XLA MB | error |")
    print("|---|---|---|---|---|---:|---:|---:|")
    for family, mesh, placement, params, opt, batch, seq, kernel in GRID:
        if only and family not in only:
            continue
        start = time.perf_counter()
        got = plan.measure(subject(family, kernel), batch_size=batch, seq_len=seq, placement=placement, mesh=mesh,
                           param_memory=params, opt_memory=opt, compiler_options=options)
        est = got.predicted
        err = est.device_bytes / got.device_bytes - 1
        worst.append(err)
        label = placement or "none"
        if kernel:
            label += f", `{kernel}` kernel"
        print(f"| {family} | {mesh or 'one device'} | {label} | {params}/{opt} | {batch}x{seq} | "
              f"{est.device_bytes / 1e6:.1f} | {got.device_bytes / 1e6:.1f} | {err:+.1%} |  <!-- {time.perf_counter() - start:.0f} s -->",
              flush=True)  # fmt: skip
    print(f"\nworst error: {max(worst):+.1%} / {min(worst):+.1%} over {len(worst)} rows (jax {jax.__version__})")


if __name__ == "__main__":
    main()
