#!/bin/bash
# s18 call e: llama-1b ShareGPT greedy, compiled, new (3442b05) against old (cf2db03), alternating
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s18/old/hf_paged > /dev/null 2>&1
mkdir -p $OUT/e
NEW=$PWD; OLD=$PWD/benchmarks/scratch/s18/old
for t in new old; do
  D=$([ $t = old ] && echo $OLD || echo $NEW)
  (cd $D && PYTHONPATH=$D timeout 140 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e_$t --no-progress > $OUT/e/$t.log 2>&1)
  echo "$t: $(grep -E '^\| paged' $OUT/e/$t.log | head -3 | tr '\n' ' ')"
done
