#!/bin/bash
# host work per step on the GPU machine's CPU (new / head, twice each), the changed modules' tests on the GPU,
# llama-1b ShareGPT greedy compiled (new / head / new)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
export PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/results/h100_2026-11-26d/scripts
host() { echo "== host $1"; PYTHONPATH=$PWD timeout 100 python3 $PWD/$S/host_all.py > $OUT/host_$1.log 2>&1; tail -5 $OUT/host_$1.log | head -4; }
hosthead() { echo "== host $1"; (cd benchmarks/scratch/head && PYTHONPATH=$PWD timeout 100 python3 /$OLDPWD/$S/host_all.py > $OUT/host_$1.log 2>&1); tail -5 $OUT/host_$1.log | head -4; }
host new1; hosthead head1; host new2; hosthead head2
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_decode_batch.py tests/test_pipelined_decode.py > $OUT/tests.log 2>&1; tail -1 $OUT/tests.log; grep -E "FAIL|Error" $OUT/tests.log | head
export PYTHONPATH=$PWD
e2e() { timeout 120 python3 benchmarks/bench_generate.py --model $2 --workload $3 $4 --systems paged_compiled --out /tmp/e2e_$1 --no-progress > $OUT/$1.log 2>&1; cp /tmp/e2e_$1/*.json $OUT/$1.json; echo "== e2e $1"; grep -A3 "bound:" $OUT/$1.log | tail -1; grep "steady" $OUT/$1.log | head -1; }
e2e llama_new1 llama-1b sharegpt ""
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e llama_head llama-1b sharegpt ""; cd ../../..
e2e llama_new2 llama-1b sharegpt ""
