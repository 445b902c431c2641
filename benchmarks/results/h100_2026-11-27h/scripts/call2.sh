#!/bin/bash
# call 2: GPU idle and host time per step, qwen2.5-0.5b and llama-1b, ShareGPT greedy
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
for m in qwen2.5-0.5b llama-1b; do
timeout 200 python3 benchmarks/scratch/s20/idle.py --model $m --runs 1 --out $OUT > $OUT/idle_$m.log 2>&1; echo "$m rc $?"
grep -v Warn $OUT/idle_$m.log | grep -v warn | tail -22
done
