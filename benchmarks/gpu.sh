#!/usr/bin/env bash
# The GPU run of every benchmark, prepared to finish in under 5 minutes on one H200:
#
#   bash benchmarks/gpu.sh            # writes benchmarks/results/gpu-<device>-<date>-quick.{md,png}
#
# bf16 compute over float32 parameters, the placement benchmark's XLA flags
# (latency-hiding scheduler, host-memory offloading), MFU against the GPU's bf16 matmul peak
# measured in the same run. Peers: transformers needs a CUDA build of torch (--torch-python),
# MaxText a venv made with `MAXTEXT_PLATFORM=gpu bash benchmarks/maxtext_setup.sh`; either is
# reported as missing otherwise. Needs jax with CUDA (`pip install -e . "jax[cuda12]"`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" 2>/dev/null; then
  echo "gpu.sh: jax sees no GPU; trying to install jax[cuda12] at the installed jax version" >&2
  JAXV="$("$PY" -c 'import jax; print(jax.__version__)' 2>/dev/null || echo '')"
  "$PY" -m pip install -q -e . "jax[cuda12]${JAXV:+==$JAXV}" >&2 \
    || { echo "gpu.sh: no CUDA jax here (no index reachable?); nothing to measure" >&2; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >&2 || true
# 195 s for the benchmarks, shared out: train step 39% (2 models, peers, compile at 2 and 32 layers), its matmuls alone 11%
# (DeepSeek-V3), placement 16% (both models: no map, full remat, host offload; max batch up to 8), MoE 9% (bench shape),
# generation 9%, long sequences 10%, attention paths 6% (the Triton kernel's first check on a GPU); a part
# that runs out of time is reported as failed and the others still run.
timeout 200 "$PY" benchmarks/run_all.py --platform gpu --quick --total 195 "$@" || echo "gpu.sh: run_all.py failed" >&2
# Then ~90 s: the Llama bench preset trained briefly with a host-offload map and with full remat, steps 4-5 profiled
# with the step's GPU XLA options (recipes/train.py prints them), each report's exposed-copy share and achieved
# bandwidth beside the planner's predicted step: the overlap verified and the cost model calibrated in one run.
RESULTS="benchmarks/results/gpu-profile-$(date +%Y%m%d)"
mkdir -p "$RESULTS"
for MAP in offload_attn remat; do
  RUN="$RESULTS/$MAP"
  timeout 40 "$PY" recipes/train.py --preset bench --compute-dtype bfloat16 --placement "$MAP" --batch-size 16 \
    --seq-len 1024 --steps 6 --warmup 1 --log-every 6 --eval-every 6 --checkpoint-every 100 --peak-tflops 989 \
    --profile 4:6 --run-dir "$RUN" --overwrite > "$RUN.train.txt" 2>&1 || echo "gpu.sh: $MAP run failed ($RUN.train.txt)" >&2
  timeout 15 "$PY" recipes/profile.py "$RUN" --top 10 | tee "$RUN.report.txt" || true
done
timeout 15 "$PY" - <<'PREDICT' | tee "$RESULTS/predicted.txt" || true
from zoo import plan, llama
for row in plan.price(llama.preset("bench"), {"offload_attn": "offload_attn", "remat": "remat"}, seq_len=1024,
                      batch_size=16, hardware="h200"):
    print(f"planner, {row.label}: predicted step {row.step_time * 1e3:.2f} ms (h200 table)")
PREDICT
