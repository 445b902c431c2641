#!/bin/bash
# call 4: Qwen3 prefill steps, new (d8844bf) against old (78d6673): host and GPU time per step, kernels by CUDA time
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/scratch/s22
t0=$(date +%s)
timeout 100 python3 $S/prefill_ab.py new > $OUT/new.log 2>&1; echo "new rc $? at $(( $(date +%s) - t0 )) s"; grep "^new" $OUT/new.log
(cd $S/old && PYTHONPATH=$PWD timeout 100 python3 ../prefill_ab.py old > $OUT/old.log 2>&1; echo "old rc $? at $(( $(date +%s) - t0 )) s"); grep "^old" $OUT/old.log
