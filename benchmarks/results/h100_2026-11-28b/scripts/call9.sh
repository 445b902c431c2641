#!/bin/bash
# call 9: the pool-sizing check on CUDA (another process holding half the GPU), and the benchmark's engines (auto
# sizing at 0.9, two engines in one process) not refused by it
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_pool_sizing.py > $OUT/tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - t0 )) s"; tail -3 $OUT/tests.log
timeout 200 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled,paged --system-timeout 150 --no-progress --out $OUT/llama > $OUT/llama.log 2>&1; echo "llama rc $? at $(( $(date +%s) - t0 )) s"
grep -A3 "^| system | run s" $OUT/llama.log; grep "Error\|error" $OUT/llama.log | head -5
rm -f $OUT/*.png $OUT/*/*.png
