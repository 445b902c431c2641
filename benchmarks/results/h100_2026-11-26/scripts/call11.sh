#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/prev/hf_paged > /dev/null 2>&1
hs() { for a in "" "--sampled" "--prefix-caching" "--prefix-caching --sampled"; do echo "== $1 $a"; CUDA_VISIBLE_DEVICES= python3 benchmarks/bench_host_step.py --steps 400 --running 64,256 $a --out /tmp/hs 2>&1 | grep "^| [0-9]"; done; }
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_decode_batch.py tests/test_pipelined_decode.py tests/test_kernel_sampling.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log; grep FAIL $OUT/tests.log | head
hs new > $OUT/host_step_new.log 2>&1 &
(cd benchmarks/scratch/prev && PYTHONPATH=$PWD hs prev > $OUT/host_step_prev.log 2>&1) &
wait
cat $OUT/host_step_new.log $OUT/host_step_prev.log
python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e --no-progress > $OUT/llama.log 2>&1
grep -A3 "bound:" $OUT/llama.log | tail -2; grep "steady" $OUT/llama.log
python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled --out /tmp/e2e --no-progress > $OUT/qwen3.log 2>&1
grep -A3 "bound:" $OUT/qwen3.log | tail -2; grep "steady" $OUT/qwen3.log
