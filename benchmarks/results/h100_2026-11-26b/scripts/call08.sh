#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/head/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_argmax.py tests/test_fused_decode.py tests/test_gpu.py tests/test_kernel_sampling.py tests/test_compile_default.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log; grep -E "FAIL|Error" $OUT/tests.log | head
timeout 60 python3 benchmarks/bench_sampling.py --quick --greedy-only --out $OUT/sampling > $OUT/argmax.log 2>&1; grep "|" $OUT/argmax.log | tail -20
e2e() { timeout 150 python3 benchmarks/bench_generate.py --model $2 --workload $3 $4 --systems $5 --out $OUT/e2e_$1 --no-progress > $OUT/$1.log 2>&1; echo "== e2e $1"; grep -A5 "bound:" $OUT/$1.log | tail -3; grep "steady\|generate_batch" $OUT/$1.log | head -4; }
e2e llama_final llama-1b sharegpt "" paged_compiled,paged,generate_batch_graphs
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e llama_head llama-1b sharegpt "" paged_compiled; cd ../../..
e2e qwen_final qwen3-0.6b uniform "--temperature 0.6 --top-p 0.95" paged_compiled
