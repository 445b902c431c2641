#!/bin/bash
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/g
VARIANTS='{"new": ["new", {}], "split_last": ["exp", {}], "zero": ["new", {"seq_zero": true}], "zero_s1": ["new", {"seq_zero": true, "num_splits": 1}], "nowrite": ["new", {"no_write": true}]}' \
  python3 benchmarks/scratch/s6/kernel_ab.py 2>&1 | grep -v Warn | tee $OUT/g/kernel_ab.log
cp /tmp/kernel_ab.json $OUT/g/ 2>/dev/null
