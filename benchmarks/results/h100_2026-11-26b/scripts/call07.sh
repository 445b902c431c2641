#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/head/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
timeout 130 python3 benchmarks/bench_startup.py --models llama-1b,qwen3-0.6b --modes compiled --out $OUT/startup_new > $OUT/startup_new.log 2>&1; grep -E "engine total" $OUT/startup_new.log
cd benchmarks/scratch/head && PYTHONPATH=$PWD timeout 130 python3 benchmarks/bench_startup.py --models llama-1b,qwen3-0.6b --modes compiled --out $OUT/startup_head > $OUT/startup_head.log 2>&1; grep -E "engine total" $OUT/startup_head.log; cd ../../..
timeout 130 python3 benchmarks/bench_startup.py --models llama-1b,qwen3-0.6b --modes compiled --out $OUT/startup_new2 > $OUT/startup_new2.log 2>&1; grep -E "engine total" $OUT/startup_new2.log
