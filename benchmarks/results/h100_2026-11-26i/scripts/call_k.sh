#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/k
timeout 200 python3 benchmarks/scratch/s9/launch_costs.py 2>&1 | grep -v "Warn\|warn" | tee $OUT/k/launch_costs.log
