#!/bin/bash
# H100: a pool-bound backlog (KV pool of 2 GiB / 512 MiB), block-aware batches (1) against places only (0), alternating
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/e
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
run() {
  local tag=$1 short=$2; shift 2
  BLOCKS=$short timeout 150 python3 benchmarks/scratch/s10/with_blocks.py benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/e/$tag.log
  grep -A2 "bound / run" $OUT/e/$tag.log | tail -1 | sed "s/^/$tag /"
}
S="--model llama-1b --workload sharegpt --num-requests 1000 --kv-cache-memory 2GiB"
A="--model llama-1b --workload alpaca --num-requests 1000 --kv-cache-memory 256MiB"
run sg_on 1 $S; run sg_off 0 $S; run al_on 1 $A; run al_off 0 $A
run sg_on2 1 $S; run sg_off2 0 $S; run al_on2 1 $A; run al_off2 0 $A
