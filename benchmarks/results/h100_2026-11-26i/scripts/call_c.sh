#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/c
for f in 1 0; do
  IN_PLACE=$f TORCH_LOGS="fusion,output_code" timeout 200 python3 benchmarks/scratch/s9/fusion_why.py > $OUT/c/fusion_$f.log 2>&1
  grep "tokens" $OUT/c/fusion_$f.log
  grep -i "cannot fuse\|can not fuse\|WhyNoFuse\|no fuse" $OUT/c/fusion_$f.log | grep -v "extern but\|node1 is nop" | head -30
done
ls -la $OUT/c
