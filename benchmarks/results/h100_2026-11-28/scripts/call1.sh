#!/bin/bash
# call 1: GPU check of the per-engine compile entries (d8844bf = new) against 78d6673 (old): ShareGPT llama-1b
# alternating, every architecture compiled on CUDA, start-up cold/warm
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/scratch/s22
t0=$(date +%s)
timeout 100 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 3 > $OUT/startup.log 2>&1; echo "startup rc $? at $(( $(date +%s) - t0 )) s"
tail -6 $OUT/startup.log
bench() { # tag dir
  if [ "$2" = "." ]; then timeout 90 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --no-progress --out $OUT/$1 > $OUT/$1.log 2>&1; echo "$1 rc $? at $(( $(date +%s) - t0 )) s";
  else (cd $S/$2 && PYTHONPATH=$PWD timeout 90 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --no-progress --out $OUT/$1 > $OUT/$1.log 2>&1; echo "$1 rc $? at $(( $(date +%s) - t0 )) s"); fi
  grep -A2 "^| system | run s" $OUT/$1.log | tail -1; grep "GPU busy" $OUT/$1.log
}
bench new1 .
bench old1 old
bench new2 .
bench old2 old
timeout 200 python3 benchmarks/probe_compiled.py --jobs 14 --out $OUT/gpu_architectures.json > $OUT/probe.log 2>&1; echo "probe rc $? at $(( $(date +%s) - t0 )) s"
tail -3 $OUT/probe.log
grep -E "\| (differs|error) \|" $OUT/probe.log | head
