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
# 285 s in all, shared out: train step 39% (2 models, peers, compile at 2 and 32 layers), its matmuls alone 11% (DeepSeek-V3),
# placement 16% (both models: no map, full remat, host offload; max batch up to 8), MoE 9% (bench shape), generation 9%,
# long sequences 10%, attention paths 6% (the Triton kernel's first check on a GPU); a part
# that runs out of time is reported as failed and the others still run.
timeout 295 "$PY" benchmarks/run_all.py --platform gpu --quick --total 285 "$@"
