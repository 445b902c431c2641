#!/usr/bin/env bash
# One GPU session's measurements (device tool, nvidia-h100-x1), in order of importance, each under its own time
# limit so that the whole call ends inside the session's device budget:
#   1. end-to-end throughput, llama-1b shape, 256 ShareGPT-like requests: hf_paged, hf_paged with compiled
#      submodules, transformers' generate_batch with CUDA graphs, in one process (bench_generate.py);
#   2. beam search, llama-8b shape, 100 prompts x 256 + 256 tokens, beams 4, 6, 8: hf_paged vs transformers
#      (bench_beam.py);
#   3. the GPU tests (CUDA-graph path == eager path, Triton kernels, prefix caching and beams on CUDA).
# The decode kernel microbenchmark (bench_decode_kernel.py) and DynamicCache (bench_generate.py --systems dynamic,
# about 3 minutes) ran in the session before; kernels unchanged since.
# Usage there: bash benchmarks/run_h100.sh "$OUT"   (logs and results.tgz land in $OUT)
set -u
OUT=${1:?usage: run_h100.sh OUT_DIR}
RES=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=python3
stamp() { echo "== $(date +%T) $*"; }

{
  stamp environment
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch, triton, transformers, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"

stamp bench_generate
timeout 170 $PY benchmarks/bench_generate.py --model llama-1b --workload sharegpt --num-requests 256 \
  --systems paged,paged_compiled,generate_batch_graphs --system-timeout 100 --no-progress \
  --out "$RES" > "$OUT/generate.log" 2>&1
echo "exit $?" >> "$OUT/generate.log"
tail -n 12 "$OUT/generate.log"

stamp bench_beam
timeout 210 $PY benchmarks/bench_beam.py --model llama-8b --beams 4,6,8 --out "$RES" > "$OUT/beam.log" 2>&1
echo "exit $?" >> "$OUT/beam.log"
tail -n 10 "$OUT/beam.log"

stamp gpu tests
timeout 80 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_kernels.py tests/test_beam.py \
  tests/test_engine_prefix_cache.py > "$OUT/tests.log" 2>&1
echo "exit $?" >> "$OUT/tests.log"
tail -n 6 "$OUT/tests.log"

tar czf "$OUT/results.tgz" -C "$RES" .
stamp done
