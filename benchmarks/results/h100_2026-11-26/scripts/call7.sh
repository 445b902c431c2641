#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_compile_default.py tests/test_kernel_sampling.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log; grep FAIL $OUT/tests.log | head
python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 150 --out /tmp/e2e --no-progress > $OUT/llama.log 2>&1
grep -A4 "bound:" $OUT/llama.log | tail -5; grep "steady" $OUT/llama.log
python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled,paged --out /tmp/e2e --no-progress > $OUT/qwen3.log 2>&1
grep -A4 "bound:" $OUT/qwen3.log | tail -4; grep "steady" $OUT/qwen3.log
cp /tmp/e2e/*.json $OUT/
