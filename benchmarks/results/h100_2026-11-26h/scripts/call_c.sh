#!/bin/bash
# H100: the decode kernel's combine unrolled (td_c4 / td_c8) vs committed; the greedy pick's launch shape
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/c
export EXP_MODULES=td_c4,td_c8
export VARIANTS='{"new": ["new", {}], "c4": ["td_c4", {}], "c8": ["td_c8", {}], "new2": ["new", {}]}'
AB_NAME=combine_ab timeout 300 python3 benchmarks/scratch/s8/stream_ab.py 2>&1 | grep -v Warn | tee $OUT/c/combine_ab.log
mv $OUT/combine_ab.json $OUT/c/ 2>/dev/null
timeout 200 python3 benchmarks/scratch/s8/argmax_sweep.py 2>&1 | grep -v Warn | tee $OUT/c/argmax_sweep.log
mv $OUT/argmax_sweep.json $OUT/c/ 2>/dev/null
