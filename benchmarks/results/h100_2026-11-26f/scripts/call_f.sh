#!/bin/bash
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/f
python3 benchmarks/scratch/s6/ncu_decode.py
for r in 256 24; do
ROWS=$r timeout 250 ncu --kernel-name regex:_paged_decode_kernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis \
  python3 benchmarks/scratch/s6/ncu_decode.py > $OUT/f/ncu_$r.txt 2>&1
grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Block Limit|Waves Per SM|Stall|Warp Cycles Per Issued|Issued Warp|L2 Hit|L1/TEX Hit|Grid Size|Dynamic Shared|Static Shared|Eligible" $OUT/f/ncu_$r.txt | head -40
done
