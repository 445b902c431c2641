#!/bin/bash
# call 7 (H200): the decode kernel's shortest split run (MIN_TOKENS_PER_SPLIT 256, the default, against 128 / 64),
# alternating, end to end on qwen2.5-0.5b (2 KV heads) and llama-1b
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
t0=$(date +%s)
for spec in qwen2.5-0.5b:256 qwen2.5-0.5b:128 qwen2.5-0.5b:64 qwen2.5-0.5b:64 qwen2.5-0.5b:128 qwen2.5-0.5b:256 llama-1b:256 llama-1b:128 llama-1b:128 llama-1b:256; do
  model=${spec%:*}; m=${spec#*:}
  [ $(( $(date +%s) - t0 )) -gt 250 ] && break
  timeout 60 python3 benchmarks/scratch/s24/split_ab.py $m --model $model --workload sharegpt --systems paged_compiled --no-progress --out /tmp/s > /tmp/s.log 2>&1
  echo "$model min $m rc $? at $(( $(date +%s) - t0 )) s: $(grep -A2 'bound / run' /tmp/s.log | tail -1 | cut -d'|' -f3-4)"
  grep "a decode step's GPU time" /tmp/s.log | sed 's/.*a decode step/  decode step/'
done
