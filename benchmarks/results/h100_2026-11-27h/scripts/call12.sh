#!/bin/bash
# call 12: bench_generate.py with its GPU timeline (uncommitted tree: gpu_timeline.py)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
for m in llama-1b qwen2.5-0.5b; do
timeout 120 python3 benchmarks/bench_generate.py --model $m --workload sharegpt --systems paged_compiled --no-progress --out $OUT/$m > $OUT/$m.log 2>&1; echo "$m rc $?"
grep -A2 "^| system | run s" $OUT/$m.log | tail -1; grep "GPU busy\|prefill steps of" $OUT/$m.log
done
