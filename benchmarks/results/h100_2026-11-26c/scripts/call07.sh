#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/head/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
e2e() { timeout 110 python3 benchmarks/bench_generate.py --model $2 --workload $3 $4 --systems paged_compiled --out /tmp/e2e_$1 --no-progress > $OUT/$1.log 2>&1; cp /tmp/e2e_$1/*.json $OUT/$1.json; echo "== e2e $1"; grep -A3 "bound:" $OUT/$1.log | tail -1; grep "steady" $OUT/$1.log | head -1; }
e2e llama_new1 llama-1b sharegpt ""
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e llama_head llama-1b sharegpt ""; cd ../../..
e2e llama_new2 llama-1b sharegpt ""
e2e qwen_new qwen3-0.6b uniform "--temperature 0.6 --top-p 0.95"
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e qwen_head qwen3-0.6b uniform "--temperature 0.6 --top-p 0.95"; cd ../../..
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fused_decode.py tests/test_kernels.py tests/test_compile_default.py tests/test_pipelined_decode.py tests/test_argmax.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log; grep -E "FAIL|Error" $OUT/tests.log | head
