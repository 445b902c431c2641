#!/bin/bash
# H100: the greedy run, step by step against its bound (timeline2.py)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 400 python3 benchmarks/scratch/s10/timeline2.py llama-1b 2>&1 | grep -v "Warn\|warn" | tee $OUT/timeline_llama.log | head -c 60000 | tail -c 11000
