#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1 &
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
mkdir -p $OUT/a
wait
timeout 200 python3 benchmarks/scratch/s18/step_kernels.py --model llama-1b --until 0 64 24 --out $OUT/a/llama 2>&1 | grep -v Warn | tail -5
timeout 200 python3 benchmarks/scratch/s18/step_kernels.py --model qwen2.5-0.5b --until 0 24 --out $OUT/a/qwen25 2>&1 | grep -v Warn | tail -5
