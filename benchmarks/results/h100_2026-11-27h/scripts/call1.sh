#!/bin/bash
# call 1: where a ShareGPT greedy run's time goes (GPU busy / idle per step, host phases)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/scratch/s20/idle.py --model llama-1b --runs 2 --out $OUT > $OUT/idle_llama.log 2>&1; echo "llama rc $?"
grep -v Warn $OUT/idle_llama.log | grep -v warn | tail -30
timeout 200 python3 benchmarks/scratch/s20/idle.py --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95 --runs 1 --out $OUT > $OUT/idle_qwen3.log 2>&1; echo "qwen3 rc $?"
grep -v Warn $OUT/idle_qwen3.log | grep -v warn | tail -14
