#!/bin/bash
# call 8: HEAD (f403aa5: the whole-forward compile refactor not yet run on a GPU) end to end, the two decode
# rows, and the GPU tests
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 200 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 150 --no-progress --out $OUT/llama > $OUT/llama.log 2>&1; echo "llama rc $? at $(( $(date +%s) - t0 )) s"
grep -A4 "^| system | run s" $OUT/llama.log; grep "GPU busy\|x generate_batch" $OUT/llama.log | head -4; grep "^| paged_compiled (steady" $OUT/llama.log
timeout 120 python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95 --systems paged_compiled --no-progress --out $OUT/qwen3 > $OUT/qwen3.log 2>&1; echo "qwen3 rc $? at $(( $(date +%s) - t0 )) s"
grep -A2 "^| system | run s" $OUT/qwen3.log
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_memory_lifetime.py > $OUT/tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - t0 )) s"; tail -3 $OUT/tests.log
rm -f $OUT/*.png $OUT/*/*.png
