#!/bin/bash
export PYTHONUNBUFFERED=1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/head/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
e2e() { timeout 100 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out $OUT/e2e_$1 --no-progress > $OUT/$1.log 2>&1; echo "== e2e $1"; grep -A3 "bound:" $OUT/$1.log | tail -1; grep "steady" $OUT/$1.log | head -1; }
for i in 1 2; do
e2e llama_new_$i
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e llama_head_$i; cd ../../..
done
