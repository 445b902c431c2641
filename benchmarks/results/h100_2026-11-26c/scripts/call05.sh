#!/bin/bash
export PYTHONUNBUFFERED=1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/head/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
e2e() { timeout 100 python3 $2 --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e_$1 --no-progress > $OUT/$1.log 2>&1; cp /tmp/e2e_$1/*.json $OUT/$1.json; echo "== e2e $1"; grep -A3 "bound:" $OUT/$1.log | tail -1; grep "steady" $OUT/$1.log | head -1; }
e2e fold1 benchmarks/bench_generate.py
e2e nofold1 benchmarks/scratch/nofold.py
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e head1 benchmarks/bench_generate.py; cd ../../..
e2e fold2 benchmarks/bench_generate.py
e2e nofold2 benchmarks/scratch/nofold.py
timeout 90 python3 benchmarks/scratch/gc_probe.py $OUT > $OUT/gc_probe.log 2>&1; grep label $OUT/gc_probe.log | cut -c1-400
timeout 200 python3 benchmarks/probe_compiled.py --jobs 14 --out $OUT/gpu_architectures_fp32.json > $OUT/probe_fp32.log 2>&1; tail -3 $OUT/probe_fp32.log; grep -iE "differ|error|mismatch" $OUT/probe_fp32.log | head
