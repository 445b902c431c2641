#!/bin/bash
# call 5: the llama-1b row at d8844bf (compiled, eager, transformers generate_batch + graphs), start-up warm
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 210 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 150 --no-progress --out $OUT/llama > $OUT/llama.log 2>&1; echo "llama rc $? at $(( $(date +%s) - t0 )) s"
grep -A5 "^| system | wall" $OUT/llama.log; grep -A4 "^| system | run s" $OUT/llama.log
timeout 150 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 3 > $OUT/startup.log 2>&1; echo "startup rc $? at $(( $(date +%s) - t0 )) s"
grep "compiled  " $OUT/startup.log
rm -f $OUT/*/*.png
