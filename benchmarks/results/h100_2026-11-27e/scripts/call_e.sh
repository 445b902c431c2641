#!/bin/bash
# s17 call e: start-up with Python's bytecode primed by bench_startup itself (llama-1b, Qwen3-0.6B shape, compiled);
# the llama-1b ShareGPT greedy row of the table
export PYTHONUNBUFFERED=1
mkdir -p $OUT/e
timeout 420 python3 benchmarks/bench_startup.py --models llama-1b,qwen3-0.6b --modes compiled --out $OUT/e > $OUT/e/startup.log 2>&1
grep -E "primed|engine total|^\|" $OUT/e/startup.log
export PYTHONPYCACHEPREFIX=/tmp/pycache
timeout 150 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e_llama --no-progress > $OUT/e/llama.log 2>&1
cp /tmp/e_llama/*.json $OUT/e/ 2>/dev/null
grep -A3 "bound / run" $OUT/e/llama.log | grep "^| paged"
