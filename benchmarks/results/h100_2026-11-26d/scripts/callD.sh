#!/bin/bash
# the final tree: host work per step on the GPU machine's CPU, steady and finishing (new / head alternating, same
# harness), and the host-bound "tiny" shape end to end, greedy and sampled (new / head alternating)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
export PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name --format=csv,noheader
NEW=$PWD
S=benchmarks/results/h100_2026-11-26d/scripts
export BENCH_DIR=$NEW/benchmarks
host() { echo "== host $1" | tee -a $OUT/host.log; (cd $2 && PYTHONPATH=$PWD timeout 120 python3 $NEW/$S/host_all.py 2>&1 | grep " ms$\|hf_paged from" | tee -a $OUT/host.log); }
host new1 $NEW; host head1 $NEW/benchmarks/scratch/head
e2e() { timeout 100 python3 benchmarks/bench_generate.py --model $2 --workload $3 $4 --systems paged_compiled --out /tmp/e2e_$1 --no-progress > /tmp/$1.log 2>&1; echo "== e2e $1" | tee -a $OUT/e2e.log; cat /tmp/e2e_$1/*.json > $OUT/$1.json; grep -A3 "bound:" /tmp/$1.log | tail -1 | tee -a $OUT/e2e.log; grep "steady" /tmp/$1.log | head -1 | tee -a $OUT/e2e.log; }
export PYTHONPATH=$PWD
for i in 1 2; do
e2e tiny_new$i tiny sharegpt ""
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e tiny_head$i tiny sharegpt ""; cd $NEW
done
e2e tinys_new tiny sharegpt "--temperature 0.6 --top-p 0.95"
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e tinys_head tiny sharegpt "--temperature 0.6 --top-p 0.95"; cd $NEW
host new2 $NEW; host head2 $NEW/benchmarks/scratch/head
