#!/bin/bash
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/b
nvidia-smi --query-gpu=name --format=csv | tee $OUT/b/gpu.txt
OUT=$OUT/b timeout 500 python3 benchmarks/scratch/s7/gated_sweep.py 2>&1 | grep -v Warn | tee $OUT/b/sweep.log
