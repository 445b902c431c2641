#!/bin/bash
# s17 call g: llama-1b compiled start-up, bytecode primed by the bench, four warm starts
export PYTHONUNBUFFERED=1
mkdir -p $OUT/g
timeout 220 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 4 --out $OUT/g > $OUT/g/startup.log 2>&1
grep -E "primed|engine total|^\|" $OUT/g/startup.log
