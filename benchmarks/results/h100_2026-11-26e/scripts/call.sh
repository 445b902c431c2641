#!/bin/bash
# 2a8042a (new) against 11028ab (head, in benchmarks/scratch/head): host work per step on the GPU machine's CPU,
# steady and finishing, alternating trees, same harness; then the host-bound "tiny" shape end to end, greedy
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name --format=csv,noheader
NEW=$PWD
S=benchmarks/results/h100_2026-11-26d/scripts  # its host_all.py: the same harness driver as that call
export BENCH_DIR=$NEW/benchmarks
host() { echo "== host $1" | tee -a $OUT/host.log; (cd $2 && PYTHONPATH=$PWD timeout 100 python3 $NEW/$S/host_all.py 2>&1 | grep " ms$\|hf_paged from" | tee -a $OUT/host.log); }
host new1 $NEW; host head1 $NEW/benchmarks/scratch/head; host new2 $NEW; host head2 $NEW/benchmarks/scratch/head
e2e() { timeout 60 python3 benchmarks/bench_generate.py --model tiny --workload sharegpt --systems paged_compiled --out /tmp/e2e_$1 --no-progress > /tmp/$1.log 2>&1; echo "== e2e $1" | tee -a $OUT/e2e.log; grep -A3 "bound:" /tmp/$1.log | tail -1 | tee -a $OUT/e2e.log; grep "steady" /tmp/$1.log | head -1 | tee -a $OUT/e2e.log; }
export PYTHONPATH=$PWD
e2e tiny_new; (cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e tiny_head)
