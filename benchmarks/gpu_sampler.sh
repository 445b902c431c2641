#!/usr/bin/env bash
# The sampler's GPU checks (device tool, nvidia-h100-x1): the kernel's and the top-k fast path's tests on CUDA (Triton
# == torch reference on real shapes, plus the CPU-sized ones on the GPU), then benchmarks/bench_sampling.py (its
# top-k table included). Logs, JSON and PNG land in OUT.
# Usage there: bash benchmarks/gpu_sampler.sh "$OUT" [--quick]
set -u
OUT=${1:?usage: gpu_sampler.sh OUT_DIR [--quick]}
shift
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
stamp() { echo "== $(date +%T) $*"; }
stamp tests
timeout 420 python3 -m pytest -q -rs tests/test_kernel_sampling.py tests/test_sampling_top_k.py tests/test_radix_select.py > "$OUT/sampler_tests.log" 2>&1
echo "tests rc=$?"; tail -n 15 "$OUT/sampler_tests.log"
stamp bench
timeout 420 python3 benchmarks/bench_sampling.py --out "$OUT" "$@" > "$OUT/bench_sampling.log" 2>&1
echo "bench rc=$?"; cat "$OUT/bench_sampling.log"
stamp done
