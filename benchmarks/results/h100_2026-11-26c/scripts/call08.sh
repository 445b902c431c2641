#!/bin/bash
export PYTHONUNBUFFERED=1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
e2e() { timeout 200 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems $2 --out /tmp/e2e_$1 --no-progress > $OUT/$1.log 2>&1; cp /tmp/e2e_$1/*.json $OUT/$1.json; echo "== e2e $1"; grep -A5 "bound:" $OUT/$1.log | tail -3; grep "steady\|generate_batch" $OUT/$1.log | head -4; }
CUDA_MODULE_LOADING=EAGER e2e llama_eagerload paged_compiled
e2e llama_final paged_compiled,paged,generate_batch_graphs
