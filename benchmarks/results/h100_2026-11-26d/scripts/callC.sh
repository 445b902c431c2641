#!/bin/bash
# host-bound end to end: the "tiny" shape (2 layers, hidden 128) on ShareGPT-like 256 requests, greedy and sampled,
# new / head in one call; then the GPU tests of the changed modules
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
export PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name --format=csv,noheader
NEW=$PWD
e2e() { timeout 100 python3 benchmarks/bench_generate.py --model $2 --workload $3 $4 --systems paged_compiled --out /tmp/e2e_$1 --no-progress > $OUT/$1.log 2>&1; echo "== e2e $1"; grep -A3 "bound:" $OUT/$1.log | tail -1; grep "steady" $OUT/$1.log | head -1; }
export PYTHONPATH=$PWD
e2e tiny_new1 tiny sharegpt ""
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e tiny_head1 tiny sharegpt ""; cd $NEW
e2e tiny_new2 tiny sharegpt ""
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e tiny_head2 tiny sharegpt ""; cd $NEW
e2e tinys_new tiny sharegpt "--temperature 0.6 --top-p 0.95"
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e tinys_head tiny sharegpt "--temperature 0.6 --top-p 0.95"; cd $NEW
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_pipelined_decode.py tests/test_decode_batch.py tests/test_kernel_sampling.py > $OUT/tests.log 2>&1; tail -1 $OUT/tests.log; grep -E "FAIL|Error" $OUT/tests.log | head
