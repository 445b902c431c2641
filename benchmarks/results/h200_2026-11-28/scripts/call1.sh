#!/bin/bash
# call 1 (H200): HEAD end to end on the two decode rows (with the new roofline column), and the compiled
# step's kernels in order
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
t0=$(date +%s)
timeout 210 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 150 --no-progress --out $OUT/llama > $OUT/llama.log 2>&1; echo "llama rc $? at $(( $(date +%s) - t0 )) s"
grep "^bound:" $OUT/llama.log; grep -A4 "^| system | run s" $OUT/llama.log; grep "GPU busy\|x generate_batch" $OUT/llama.log | head -4; grep "^| paged_compiled (steady" $OUT/llama.log; grep -A8 "GPU time per step\|rows" $OUT/llama.log | head -20
timeout 130 python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95 --systems paged_compiled --no-progress --out $OUT/qwen3 > $OUT/qwen3.log 2>&1; echo "qwen3 rc $? at $(( $(date +%s) - t0 )) s"
grep "^bound:" $OUT/qwen3.log; grep -A2 "^| system | run s" $OUT/qwen3.log
PYTHONPATH=$PWD timeout 150 python3 benchmarks/scratch/s24/step_kernels.py 2>&1 | grep -v Warn > $OUT/step_kernels.log; echo "kernels rc $? at $(( $(date +%s) - t0 )) s"
grep "== running" $OUT/step_kernels.log
rm -f $OUT/*.png $OUT/*/*.png
