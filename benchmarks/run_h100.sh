#!/usr/bin/env bash
# The GPU measurements of benchmarks/results/h100_2026-11-23b.md (device tool, nvidia-h100-x1). One device call may
# run 10 minutes, so the parts are chosen by name; each runs under its own time limit and leaves its log in OUT,
# its JSON and plot in OUT/results.tgz.
#   step      bench_decode_step.py: GPU time of one decode step per batch bucket, eager vs compiled CUDA graphs (~2 min)
#   generate  bench_generate.py: llama-1b, 256 ShareGPT-like requests; hf_paged (plain, compile_decode),
#             transformers' generate_batch with CUDA graphs and generate() + DynamicCache, one process (~5 min)
#   beam      bench_beam.py: llama-8b, 100 prompts x 256 + 256 tokens, beams 4, 6, 8; hf_paged (compiled, plain) and
#             transformers, one process (~6 min)
#   kernel    bench_decode_kernel.py: paged decode vs SDPA on the anchor shapes (~1 min)
#   paged     bench_generate.py: the same llama-1b workload, hf_paged only (plain and compile_decode) (~2 min)
#   sampled   bench_generate.py: Qwen3-0.6B shape, 256 requests, lengths U[100, 1024], temperature 0.6, top-p 0.95
#             (SAMPLED_SYSTEMS=,paged_compiled,generate_batch_graphs adds systems)
#   long      bench_generate.py: llama-1b, 64 requests, prompts U[2048, 8192], outputs U[32, 256] (LONG_SYSTEMS=,dynamic)
#   profile   profile_decode.py: torch profiler over 30 steady decode steps of the sampled workload
#   startup   bench_startup.py: engine construction + warm_up, eager and compile_decode, cold and warm compile caches,
#             llama-1b and the 28-layer Qwen3-0.6B shape, each in a fresh process (~4 min)
#   tests     the GPU tests (CUDA graphs and compiled steps == eager, kernels, prefix caching and beams on CUDA)
# Usage there: bash benchmarks/run_h100.sh "$OUT" generate tests
set -u
OUT=${1:?usage: run_h100.sh OUT_DIR PART...}
shift
RES=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=python3
stamp() { echo "== $(date +%T) $*"; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton, transformers, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1

for part in "$@"; do
  stamp "$part"
  case "$part" in
    step) timeout 200 $PY benchmarks/bench_decode_step.py --out "$RES" > "$OUT/step.log" 2>&1 ;;
    generate) timeout 480 $PY benchmarks/bench_generate.py --model llama-1b --workload sharegpt --num-requests 256 \
        --systems paged,paged_compiled,generate_batch_graphs,dynamic --system-timeout 260 --no-progress \
        --out "$RES" > "$OUT/generate.log" 2>&1 ;;
    beam) timeout 540 $PY benchmarks/bench_beam.py --model llama-8b --beams 4,6,8 \
        --systems paged_compiled,paged,transformers --out "$RES" > "$OUT/beam.log" 2>&1 ;;
    kernel) timeout 120 $PY benchmarks/bench_decode_kernel.py --out "$RES" > "$OUT/kernel.log" 2>&1 ;;
    paged) timeout 240 $PY benchmarks/bench_generate.py --model llama-1b --workload sharegpt --num-requests 256 \
        --systems paged,paged_compiled --system-timeout 200 --no-progress --out "$RES" > "$OUT/paged.log" 2>&1 ;;
    sampled) timeout 300 $PY benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --num-requests 256 \
        --temperature 0.6 --top-p 0.95 --systems paged${SAMPLED_SYSTEMS:-} --system-timeout 240 --no-progress \
        --out "$RES" > "$OUT/sampled.log" 2>&1 ;;
    long) timeout 300 $PY benchmarks/bench_generate.py --model llama-1b --workload long --num-requests 64 \
        --systems paged${LONG_SYSTEMS:-} --dynamic-batch-size 16 --system-timeout 240 --no-progress \
        --out "$RES" > "$OUT/long.log" 2>&1 ;;
    profile) timeout 200 $PY benchmarks/profile_decode.py --model qwen3-0.6b --workload uniform --temperature 0.6 \
        --top-p 0.95 --finished-only --out "$RES" > "$OUT/profile.log" 2>&1 ;;
    startup) timeout 420 $PY benchmarks/bench_startup.py --models llama-1b,qwen3-0.6b --modes compiled,eager \
        --out "$RES" > "$OUT/startup.log" 2>&1 ;;
    tests) timeout 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py \
        tests/test_beam.py tests/test_engine_prefix_cache.py tests/test_memory_lifetime.py > "$OUT/tests.log" 2>&1 ;;
    *) echo "unknown part $part (step, generate, paged, sampled, long, profile, beam, kernel, startup, tests)"; continue ;;
  esac
  echo "exit $?"
  tail -n 12 "$OUT/$part.log" 2>/dev/null
done
tar czf "$OUT/results.tgz" -C "$RES" .
stamp done
