#!/usr/bin/env bash
# Performance III on the GPU (issue 55): the fused experts, the FP8 KV cache and the Gemma shape, logs and JSON into OUT.
#   moe      bench_moe.py: one MoE layer's experts, hf_paged's fused Triton kernels vs transformers' grouped_mm,
#            batched_mm and eager, OLMoE / Qwen3-MoE / gpt-oss / Mixtral shapes, 1-512 rows, against the bytes bound
#   moe_e2e  OLMoE-1B-7B shape, 256 ShareGPT-like requests, compiled engine: experts hf_paged against grouped_mm
#   fp8      llama-8b shape, 512 KV-bound requests (1-3k prompt tokens), compiled engine: bf16 against FP8 KV
#   gemma    Gemma-3-1B text shape, 256 uniform requests (100-1024 prompt tokens, so most pass the 512 window),
#            Gemma's sampling (T 1.0, top-k 64, top-p 0.95): compiled and eager engine
#   gprof    where the Gemma shape's compiled decode step goes (profile_decode.py at 240 and 64 running)
#   fp8k     the decode kernel over an FP8 cache against bf16 at every shape of bench_decode_kernel.py (its default
#            tiles, CUDA graphs), MQA included
#   radix    the sampler's top-k selection, torch.topk against the Triton radix select, flat and masked rows
# Usage there: bash benchmarks/gpu_perf3.sh "$OUT" [moe] [moe_e2e] [fp8] [gemma] [gprof] [fp8k] [radix]
# (moe ... gprof by default)
set -u
OUT=${1:?usage: gpu_perf3.sh OUT_DIR [moe] [moe_e2e] [fp8] [gemma] [gprof] [fp8k] [radix]}
shift
PARTS=${*:-moe moe_e2e fp8 gemma gprof}
source benchmarks/gpu_env.sh "$OUT"  # environment, .whl/ wheels (if any), versions
BENCH="$PY benchmarks/bench_generate.py --no-progress --out $OUT"
for part in $PARTS; do
  echo "== $(date +%T) $part"
  case "$part" in
    moe) timeout 170 $PY benchmarks/bench_moe.py --out "$OUT/moe" > "$OUT/moe.log" 2>&1 ;;
    moe_e2e) for impl in hf_paged grouped_mm; do
        timeout 100 $BENCH --model olmoe-1b-7b --workload sharegpt --num-requests 256 --systems paged_compiled \
          --experts-implementation $impl --out "$OUT/olmoe_$impl" >> "$OUT/moe_e2e.log" 2>&1
      done ;;
    fp8) timeout 200 $BENCH --model llama-8b --workload kvbound --num-requests 512 --systems paged_compiled \
        --kv-cache-dtype auto,fp8 --max-num-seqs 512 > "$OUT/fp8.log" 2>&1 ;;
    gemma) timeout 150 $BENCH --model gemma3-1b --workload uniform --num-requests 256 \
        --systems paged_compiled,paged --temperature 1.0 --top-k 64 --top-p 0.95 > "$OUT/gemma.log" 2>&1 ;;
    gprof) timeout 120 $PY benchmarks/profile_decode.py --model gemma3-1b --workload uniform --temperature 1.0 \
        --top-k 64 --top-p 0.95 --compile-decode --finished-only --until-running 240,64 --steps 3 \
        --out "$OUT/gprof" > "$OUT/gprof.log" 2>&1 ;;
    fp8k) timeout 200 $PY benchmarks/bench_decode_kernel.py --cuda-graph --rep 40 --out "$OUT/fp8k" \
        > "$OUT/fp8k.log" 2>&1 ;;
    radix) timeout 200 $PY benchmarks/bench_sampling.py --topk-select torch,radix --out "$OUT/radix" \
        > "$OUT/radix.log" 2>&1 ;;
    *) echo "unknown part $part (moe, moe_e2e, fp8, gemma, gprof, fp8k, radix)"; continue ;;
  esac
  echo "exit $?"
  tail -n 30 "$OUT/$part.log"
done
