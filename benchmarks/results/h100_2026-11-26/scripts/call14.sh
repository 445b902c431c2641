#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
hs() { for a in "" "--sampled" "--prefix-caching" "--prefix-caching --sampled"; do echo "== $1 $a"; CUDA_VISIBLE_DEVICES= python3 benchmarks/bench_host_step.py --steps 400 --running 256 $a --out /tmp/hs 2>&1 | grep "^| [0-9]"; done; }
hs final > $OUT/host_step_final.log 2>&1; hs final-again >> $OUT/host_step_final.log 2>&1; cat $OUT/host_step_final.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_decode_batch.py tests/test_pipelined_decode.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log; grep FAIL $OUT/tests.log | head
python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e --no-progress > $OUT/llama.log 2>&1
grep -A3 "bound:" $OUT/llama.log | tail -1; grep "steady" $OUT/llama.log
