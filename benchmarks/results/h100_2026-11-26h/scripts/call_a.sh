#!/bin/bash
# H100: stream-K decode prototype vs the committed decode kernel, at real runs' lengths
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/a
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/a/gpu.txt
timeout 120 python3 benchmarks/scratch/s8/check_stream.py 2>&1 | tail -9 | tee $OUT/a/check.log
export EXP_MODULES=td_stream
export VARIANTS='{"new": ["new", {}],
 "st8m4s2": ["td_stream", {"programs_per_sm": 8, "min_per": 4, "num_stages": 2}],
 "st8m4s3": ["td_stream", {"programs_per_sm": 8, "min_per": 4, "num_stages": 3}],
 "st8m4s4": ["td_stream", {"programs_per_sm": 8, "min_per": 4, "num_stages": 4}],
 "st4m4s3": ["td_stream", {"programs_per_sm": 4, "min_per": 4, "num_stages": 3}],
 "st16m2s3": ["td_stream", {"programs_per_sm": 16, "min_per": 2, "num_stages": 3}],
 "st8m8s3": ["td_stream", {"programs_per_sm": 8, "min_per": 8, "num_stages": 3}],
 "st8m4s3n32": ["td_stream", {"programs_per_sm": 8, "min_per": 8, "num_stages": 3, "block_n": 32}]}'
AB_NAME=stream_ab timeout 400 python3 benchmarks/scratch/s8/stream_ab.py 2>&1 | grep -v Warn | tee $OUT/a/stream_ab.log
cp $OUT/stream_ab.json $OUT/a/ 2>/dev/null
