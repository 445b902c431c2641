#!/bin/bash
# call 9: the final tree (6cac19d): the table re-measured, start-up
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 150 --no-progress --out $OUT/llama > $OUT/llama.log 2>&1; echo "llama rc $?"
grep -A5 "^| system | wall" $OUT/llama.log; grep -A4 "^| system | run s" $OUT/llama.log
timeout 120 python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled --no-progress --out $OUT/qwen3 > $OUT/qwen3.log 2>&1; echo "qwen3 rc $?"
grep -A2 "^| system | run s" $OUT/qwen3.log | tail -1
timeout 120 python3 benchmarks/bench_generate.py --model llama-1b --workload long --num-requests 64 --systems paged_compiled --no-progress --out $OUT/long > $OUT/long.log 2>&1; echo "long rc $?"
grep -A2 "^| system | run s" $OUT/long.log | tail -1
timeout 150 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 3 > $OUT/startup.log 2>&1; echo "startup rc $?"
tail -8 $OUT/startup.log
