#!/usr/bin/env bash
# Attention options of the paged kernels on the GPU (issue 15): benchmark + GPU tests, logs and results into OUT.
#   bench  bench_attention_features.py: window / softcap / sinks decode and prefill vs SDPA / FlexAttention /
#          eager torch, plus the KV memory a window bounds on a Gemma-3-27B-shaped model (~2-3 min)
#   tests  the CUDA tests of tests/test_kernel_features.py (Triton compiled, bf16 and float32) and test_model_features
# Usage there: bash benchmarks/gpu_kernels.sh "$OUT" [bench] [tests]   (both by default)
set -u
OUT=${1:?usage: gpu_kernels.sh OUT_DIR [bench] [tests]}
shift
PARTS=${*:-bench tests}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=python3
for part in $PARTS; do
  echo "== $(date +%T) $part"
  case "$part" in
    bench) timeout 400 $PY benchmarks/bench_attention_features.py --out "$OUT" > "$OUT/bench.log" 2>&1 ;;
    tests) timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_kernel_features.py tests/test_model_features.py \
        > "$OUT/tests.log" 2>&1 ;;
    *) echo "unknown part $part (bench, tests)"; continue ;;
  esac
  echo "exit $?"
  tail -n 20 "$OUT/$part.log"
done
