#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
timeout 300 python3 benchmarks/bench_grpo_rollouts.py --model llama-1b --dtype bfloat16 --prompts 64 --generations 8 --new-tokens 256 --steps 3 --out $OUT > $OUT/grpo_rollouts.log 2>&1; echo "rc=$?" >> $OUT/grpo_rollouts.log
grep -v "arn" $OUT/grpo_rollouts.log | tail -9
timeout 240 python3 benchmarks/bench_generate.py --model llama-1b --workload long --num-requests 64 --systems paged_compiled,dynamic --dynamic-batch-size 16 --dynamic-max-batches 1 --system-timeout 100 --no-progress --out /tmp/gen > $OUT/long.log 2>&1
grep "^|\|bound" $OUT/long.log | tail -8
cp /tmp/gen/*.json $OUT/ 2>/dev/null
