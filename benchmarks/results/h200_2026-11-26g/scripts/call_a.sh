#!/bin/bash
# num_stages / block_n sweep of the decode kernel at ragged lengths (the pipeliner does run for this kernel)
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/a
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/a/gpu.txt
VARIANTS='{"new": ["new", {}], "s1": ["new", {"num_stages": 1}], "s3": ["new", {"num_stages": 3}], "s4": ["new", {"num_stages": 4}], "n32s2": ["new", {"block_n": 32, "num_stages": 2}], "n32s3": ["new", {"block_n": 32, "num_stages": 3}], "n32s4": ["new", {"block_n": 32, "num_stages": 4}], "w2s3": ["new", {"num_warps": 2, "num_stages": 3}]}' AB_NAME=sweep_a OUT=$OUT/a timeout 400 python3 benchmarks/scratch/s7/kernel_ab.py 2>&1 | grep -v Warn | tee $OUT/a/kernel.log
