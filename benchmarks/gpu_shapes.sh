#!/usr/bin/env bash
# Attention shapes and hybrids on the GPU (issues 53 and 54), logs and JSON into OUT.
#   tests     tests/test_gpu.py: block groups (Gemma 3, gpt-oss), latent attention (DeepSeek-V2, GLM-4.7-Flash), Mamba
#             and the hybrids, eager and compiled steps in CUDA graphs, against transformers' greedy tokens
#   groups    Gemma-3-1B text shape, 256 uniform requests (100-1024 prompt tokens, so most pass the 512 window),
#             Gemma's sampling, a 3 GiB KV pool: the compiled engine with block groups against one block table
#   mla       DeepSeek-V2-Lite shape, 256 ShareGPT-like requests: the compiled engine (the latent in the pool)
#             against transformers' generate() (its first batch of 64, DynamicCache)
#   hprefill  where the prefill steps of many short prompts go on the Qwen3.5-9B shape (profile_decode.py --prefill,
#             200 requests sharing a 300-token system prompt)
# flash-linear-attention (fla-core) and einops are installed from .whl/ when there (gpu_env.sh).
# Usage there: bash benchmarks/gpu_shapes.sh "$OUT" [tests] [groups] [mla] [hprefill]   (all by default)
set -u
OUT=${1:?usage: gpu_shapes.sh OUT_DIR [tests] [groups] [mla] [hprefill]}
shift
PARTS=${*:-tests groups mla hprefill}
source benchmarks/gpu_env.sh "$OUT"  # environment, .whl/ wheels, versions
BENCH="$PY benchmarks/bench_generate.py --no-progress --out $OUT"
for part in $PARTS; do
  echo "== $(date +%T) $part"
  case "$part" in
    tests) timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "${TEST_K:-grouped_latent or hybrid}" \
        > "$OUT/tests.log" 2>&1 ;;
    groups) timeout 150 $BENCH --model gemma3-1b --workload uniform --num-requests 256 --kv-cache-memory 3GiB \
        --systems paged_compiled,paged_compiled_onetable --temperature 1.0 --top-k 64 --top-p 0.95 \
        > "$OUT/groups.log" 2>&1 ;;
    mla) timeout 280 $BENCH --model deepseek-v2-lite --workload sharegpt --num-requests 256 \
        --systems paged_compiled,dynamic --dynamic-max-batches 1 --system-timeout 200 > "$OUT/mla.log" 2>&1 ;;
    hprefill) timeout 220 $PY benchmarks/profile_decode.py --model qwen3.5-9b --workload shared_system \
        --num-requests 200 --prefill --steps 6 --out "$OUT/hprefill" > "$OUT/hprefill.log" 2>&1 ;;
    *) echo "unknown part $part (tests, groups, mla, hprefill)"; continue ;;
  esac
  echo "exit $?"
  tail -n 40 "$OUT/$part.log"
done
