#!/bin/bash
export PYTHONUNBUFFERED=1
NEW=$PWD; OLD=$PWD/benchmarks/scratch/s18/old
for t in old new old new; do
  D=$([ $t = old ] && echo $OLD || echo $NEW)
  (cd $D && PYTHONPATH=$D timeout 60 python3 $NEW/benchmarks/scratch/s18/replay_time.py 2>&1 | grep retries | sed "s/^/$t /")
done
