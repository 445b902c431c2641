#!/bin/bash
# call 3: the final tree end to end (llama-1b greedy, Qwen3 shape sampled), the decode kernel's floor, GPU tests
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1 2>/dev/null || true
timeout 150 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out $OUT/llama --no-progress > $OUT/llama.log 2>&1; echo "llama rc $?"
grep -A3 "^| system | run s" $OUT/llama.log
timeout 170 python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled --system-timeout 120 --out $OUT/qwen3 --no-progress > $OUT/qwen3.log 2>&1; echo "qwen3 rc $?"
grep -A3 "^| system | run s" $OUT/qwen3.log
timeout 60 python3 benchmarks/scratch/s19/decode_floor.py > $OUT/decode_floor.log 2>&1; echo "floor rc $?"
cat $OUT/decode_floor.log | grep -v Warn
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_pipelined_decode.py tests/test_parallel_jit.py tests/test_argmax.py > $OUT/tests.log 2>&1; echo "tests rc $?"
tail -3 $OUT/tests.log
