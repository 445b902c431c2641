#!/bin/bash
# call 10: HEAD (the pool-sizing check) on the other two rows: 64 prompts of 2-8k tokens, and start-up
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 100 python3 benchmarks/bench_generate.py --workload long --num-requests 64 --systems paged_compiled --no-progress --out $OUT/long > $OUT/long.log 2>&1; echo "long rc $? at $(( $(date +%s) - t0 )) s"
grep -A2 "^| system | run s" $OUT/long.log
timeout 170 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 3 > $OUT/startup.log 2>&1; echo "startup rc $? at $(( $(date +%s) - t0 )) s"
grep "engine total" $OUT/startup.log; tail -3 $OUT/startup.log
rm -f $OUT/*.png $OUT/*/*.png
