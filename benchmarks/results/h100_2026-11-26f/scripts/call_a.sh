#!/bin/bash
# kernel A/B, GPU kernel tests, e2e head vs new (llama-1b ShareGPT greedy)
set -x
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/a
VARIANTS='{"head": ["head", {}], "new": ["new", {}], "new_n128": ["new", {"block_n": 128}]}' \
  python3 benchmarks/scratch/s6/kernel_ab.py 2>&1 | grep -v Warn | tee $OUT/a/kernel_ab.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fused_decode.py tests/test_kernels.py tests/test_kernel_features.py -x 2>&1 | tail -3 | tee $OUT/a/tests.log
for i in 1 2; do
python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e_new$i --no-progress 2>&1 | grep -A3 "bound / run" | tee $OUT/a/e2e_new$i.log
(cd benchmarks/scratch/head && PYTHONPATH=$PWD python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e_head$i --no-progress 2>&1 | grep -A3 "bound / run" | tee $OUT/a/e2e_head$i.log)
done
