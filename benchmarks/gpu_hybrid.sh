#!/usr/bin/env bash
# Hybrid models on the GPU (issue 53): the CUDA tests, then the Qwen3.5-shaped benchmarks, logs and JSON into OUT.
#   tests     tests/test_gpu.py -k hybrid: greedy tokens of transformers, eager and compiled step, CUDA graphs
#   sharegpt  256 ShareGPT-like requests: hf_paged compiled / eager, transformers generate() (its first batch of 64,
#             DynamicCache) and transformers' continuous batching if it runs the model; the bound counts weights,
#             K/V and the recurrent states each step reads and writes
#   prefill   8 prompts of 32k tokens: prefill throughput
#   shared    200 requests sharing a 300-token system prompt: prefix cache on against off
# flash-linear-attention (fla-core) and its dependency einops are installed from .whl/ when there (without einops fla
# fails to import and prefill falls back to the torch reference, which is slow; transformers then runs the gated
# DeltaNet layers through its Triton kernels, for both systems).
# Usage there: bash benchmarks/gpu_hybrid.sh "$OUT" [tests] [sharegpt] [prefill] [shared]   (all by default)
# Environment: TEST_FAMILIES (a pytest -k term, e.g. qwen3_5), SHAREGPT_SYSTEMS, PREFILL_SYSTEMS, SHARED_SYSTEMS
# (bench_generate --systems lists; eager steps with CUDA graphs, compiled, without prefix caching, transformers).
set -u
OUT=${1:?usage: gpu_hybrid.sh OUT_DIR [tests] [sharegpt] [prefill] [shared]}
shift
PARTS=${*:-tests sharegpt prefill shared}
source benchmarks/gpu_env.sh "$OUT"  # environment, .whl/ wheels, versions
$PY -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -n 1
BENCH="$PY benchmarks/bench_generate.py --model qwen3.5-9b --no-progress --out $OUT"
for part in $PARTS; do
  echo "== $(date +%T) $part"
  case "$part" in
    tests) timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "hybrid${TEST_FAMILIES:+ and $TEST_FAMILIES}" \
        > "$OUT/tests.log" 2>&1 ;;
    sharegpt) timeout 560 $BENCH --workload sharegpt --num-requests 256 --system-timeout 200 \
        --systems "${SHAREGPT_SYSTEMS:-paged,paged_compiled,dynamic}" --dynamic-max-batches 1 > "$OUT/sharegpt.log" 2>&1 ;;
    prefill) timeout 300 $BENCH --workload prefill32k --num-requests 8 --systems "${PREFILL_SYSTEMS:-paged}" \
        > "$OUT/prefill.log" 2>&1 ;;
    shared) timeout 400 $BENCH --workload shared_system --num-requests 200 \
        --systems "${SHARED_SYSTEMS:-paged,paged_nocache}" > "$OUT/shared.log" 2>&1 ;;
    *) echo "unknown part $part (tests, sharegpt, prefill, shared)"; continue ;;
  esac
  echo "exit $?"
  tail -n 25 "$OUT/$part.log"
done
