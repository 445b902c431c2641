#!/bin/bash
# H100: stream-K prototype without the step's K/V write (115 registers) vs the committed kernel without it
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/d
export EXP_MODULES=td_stream
export VARIANTS='{"new": ["new", {"no_write": true}],
 "st4m4s2": ["td_stream", {"no_write": true, "programs_per_sm": 4, "min_per": 4, "num_stages": 2}],
 "st4m4s3": ["td_stream", {"no_write": true, "programs_per_sm": 4, "min_per": 4, "num_stages": 3}],
 "st4m8s3": ["td_stream", {"no_write": true, "programs_per_sm": 4, "min_per": 8, "num_stages": 3}],
 "st8m4s3": ["td_stream", {"no_write": true, "programs_per_sm": 8, "min_per": 4, "num_stages": 3}],
 "st4m4s2w8": ["td_stream", {"no_write": true, "programs_per_sm": 4, "min_per": 4, "num_stages": 2, "num_warps": 8}]}'
AB_NAME=stream_nowrite timeout 400 python3 benchmarks/scratch/s8/stream_ab.py 2>&1 | grep -v Warn | tee $OUT/d/stream_nowrite.log
mv $OUT/stream_nowrite.json $OUT/d/ 2>/dev/null
