#!/bin/bash
# call 2 (H200): HEAD on the other rows (64 prompts of 2-8k tokens; start-up cold and warm), and the GPU tests
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 100 python3 benchmarks/bench_generate.py --workload long --num-requests 64 --systems paged_compiled --no-progress --out $OUT/long > $OUT/long.log 2>&1; echo "long rc $? at $(( $(date +%s) - t0 )) s"
grep "^bound:" $OUT/long.log; grep -A2 "^| system | run s" $OUT/long.log
timeout 170 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 3 > $OUT/startup.log 2>&1; echo "startup rc $? at $(( $(date +%s) - t0 )) s"
grep "engine total" $OUT/startup.log; tail -3 $OUT/startup.log
timeout 250 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_memory_lifetime.py tests/test_pool_sizing.py > $OUT/tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - t0 )) s"; tail -3 $OUT/tests.log
rm -f $OUT/*.png $OUT/*/*.png
