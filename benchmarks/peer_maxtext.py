"""Peer: MaxText's own trainer on synthetic data, the bench shape (run by train_step.py).

    <maxtext-venv>/bin/python benchmarks/peer_maxtext.py '{"model": "llama", "batch": 4, "seq": 256, ...}'

Runs under MaxText's interpreter (``benchmarks/maxtext_setup.sh`` makes it: Python 3.12, the
wheel's decoupled requirements), never zoo's. Starts ``maxtext.trainers.pre_train.train`` on
``configs/base.yml`` with the bench shape as overrides, ``dataset_type=synthetic``,
``DECOUPLE_GCLOUD=TRUE`` and ``skip_jax_distributed_system=true`` (MoE: ``megablox=false``,
``sparse_matmul=false``), reads the per-step ``seconds:`` MaxText logs and prints one JSON line:
the median over the steps after ``warmup`` (step 0 compiles, and dispatch runs ahead of the
first steps: timing starts at step 3 at the earliest).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile


def first_timed(spec: dict) -> int:
    """MaxText logs the time between consecutive steps, and dispatch runs ahead at first (step 0
    also compiles): steps 0..2 are never timed."""
    return max(spec["warmup"], 2) + 1


def overrides(spec: dict) -> list[str]:
    s = spec
    common = {
        "run_name": "zoo_bench",
        "hardware": "gpu" if s.get("platform") == "gpu" else "cpu",
        "skip_jax_distributed_system": "true",
        "dataset_type": "synthetic",
        "enable_checkpointing": "false",
        "enable_tensorboard": "false",
        "enable_goodput_recording": "false",
        "monitor_goodput": "false",
        "steps": str(first_timed(s) + s["steps"]),
        "log_period": "1000000",
        "per_device_batch_size": str(s["batch"]),
        "max_target_length": str(s["seq"]),
        "dtype": "bfloat16" if s.get("bf16") else "float32",
        "weight_dtype": "float32",
        "matmul_precision": "default",
        "attention": "dot_product",
        "opt_type": "adamw",
        "gradient_clipping_threshold": "1.0",
        "remat_policy": s.get("remat_policy", "minimal_with_context"),
        "scan_layers": "true",
        "packing": "false",
        "enable_dropout": "false",
        "vocab_size": "8192",
        "base_emb_dim": "512",
        "base_num_query_heads": "8",
        "base_mlp_dim": "1536",
        "base_num_decoder_layers": "4",
        "mlp_activations": "['silu','linear']",
        "logits_via_embedding": "false",
        "ici_fsdp_parallelism": "-1",
    }
    if s["model"] == "llama":
        model = {
            "decoder_block": "llama2",
            "base_num_kv_heads": "4",
            "head_dim": "64",
            "normalization_layer_epsilon": "1e-5",
            "rope_max_timescale": "500000",
        }
    else:
        model = {
            "decoder_block": "deepseek",
            "attention_type": "mla",
            "base_num_kv_heads": "8",
            "base_moe_mlp_dim": "256",
            "first_num_dense_layers": "1",
            "num_experts": "16",
            "num_experts_per_tok": "2",
            "shared_experts": "1",
            "routed_scaling_factor": "1.0",
            "routed_score_func": "sigmoid",
            "routed_bias": "true",
            "norm_topk_prob": "true",
            "megablox": "false",
            "sparse_matmul": "false",
            "capacity_factor": "-1",
            "q_lora_rank": "128",
            "kv_lora_rank": "64",
            "qk_nope_head_dim": "64",
            "qk_rope_head_dim": "32",
            "v_head_dim": "64",
            "rope_type": "yarn",
            "rope_max_timescale": "10000",
            "original_max_position_embeddings": "4096",
            "rope_factor": "40",
            "beta_fast": "32",
            "mscale": "1.0",
            "normalization_layer_epsilon": "1e-6",
        }
    return [f"{k}={v}" for k, v in {**common, **model, **s.get("extra", {})}.items()]


def main() -> None:
    spec = json.loads(sys.argv[1])
    import jax
    import maxtext

    try:
        from importlib.metadata import version

        mt_version = version("maxtext")
    except Exception:  # noqa: BLE001
        mt_version = getattr(maxtext, "__version__", "?")
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", TF_CPP_MIN_LOG_LEVEL="2")
    env["JAX_PLATFORMS"] = "cuda" if spec.get("platform") == "gpu" else "cpu"
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "maxtext.trainers.pre_train.train", base, f"base_output_directory={out}",
                *overrides(spec)]  # fmt: skip
        proc = subprocess.run(args, cwd=out, env=env, capture_output=True, text=True, timeout=spec.get("timeout", 1800))
    log = proc.stdout + proc.stderr
    if spec.get("log"):
        with open(spec["log"], "w") as f:
            f.write(log)
    steps = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"completed step: (\d+), seconds: ([0-9.]+)", log)}
    times = [t for i, t in sorted(steps.items()) if i >= first_timed(spec)]
    params = re.search(r"number parameters: ([0-9.]+) billion", log)
    versions = {"maxtext": mt_version, "jax (maxtext)": jax.__version__}
    if proc.returncode != 0 or not times:
        tail = " ".join(log.strip().splitlines()[-3:])[-400:]
        print(json.dumps({"missing": f"MaxText run failed (rc {proc.returncode}): {tail}", "versions": versions}))
        return
    print(json.dumps({"ms": 1e3 * statistics.median(times), "times_ms": [1e3 * t for t in times], "versions": versions,
                      "num_params": float(params.group(1)) * 1e9 if params else None,
                      "settings": overrides(spec)}))  # fmt: skip


if __name__ == "__main__":
    main()
