#!/bin/bash
# call 5 (H200): the residual fold into down_proj's addmm, on and off, alternating, on a small (qwen2.5-0.5b) and the
# project's (llama-1b) shape
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
t0=$(date +%s)
for model in qwen2.5-0.5b llama-1b; do for mode in on off off on; do
  timeout 90 python3 benchmarks/scratch/s24/fold_ab.py $mode --model $model --workload sharegpt --systems paged_compiled --no-progress --out /tmp/f > /tmp/f.log 2>&1
  echo "$model fold $mode rc $? at $(( $(date +%s) - t0 )) s: $(grep -A2 'bound / run' /tmp/f.log | tail -1 | cut -d'|' -f2-6) $(grep '^fold' /tmp/f.log)"
  grep "a decode step's GPU time" /tmp/f.log | sed 's/.*a decode step/  decode step/'
done; done
