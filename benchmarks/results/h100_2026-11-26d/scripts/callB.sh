#!/bin/bash
# host work per step on the GPU machine's CPU (new / head alternating, three each), sampled Qwen3-shape e2e
# (new / head), the sampler's GPU tests, compiled start-up of llama-1b, the long-prompt workload (prefill MFU)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
export PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/results/h100_2026-11-26d/scripts
NEW=$PWD
host() { echo "== host $1" | tee -a $OUT/host.log; (cd $2 && PYTHONPATH=$PWD timeout 100 python3 $NEW/$S/host_all.py 2>&1 | grep " ms$" | tee -a $OUT/host.log); }
for i in 1 2 3; do host new$i $NEW; host head$i $NEW/benchmarks/scratch/head; done
e2e() { timeout 130 python3 benchmarks/bench_generate.py --model $2 --workload $3 $4 --systems paged_compiled --out /tmp/e2e_$1 --no-progress > $OUT/$1.log 2>&1; echo "== e2e $1"; grep -A3 "bound:" $OUT/$1.log | tail -1; grep "steady" $OUT/$1.log | head -1; }
export PYTHONPATH=$PWD
e2e qwen_new qwen3-0.6b uniform "--temperature 0.6 --top-p 0.95"
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e qwen_head qwen3-0.6b uniform "--temperature 0.6 --top-p 0.95"; cd $NEW
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sampling.py tests/test_gpu.py -k "sampl or seed or pick" > $OUT/tests.log 2>&1; tail -1 $OUT/tests.log; grep -E "FAIL|Error" $OUT/tests.log | head
timeout 100 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled > $OUT/startup.log 2>&1; tail -6 $OUT/startup.log
e2e long_new llama-1b long "--num-requests 64"
