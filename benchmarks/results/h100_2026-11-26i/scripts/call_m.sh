#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/m
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
timeout 150 python3 benchmarks/scratch/s9/ttft_probe.py 2>&1 | grep "pad=" | tee $OUT/m/ttft_probe.log
run() {
  local tag=$1 pad=$2; shift 2
  PAD=$pad timeout 100 python3 benchmarks/scratch/s9/with_pad.py benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/m/$tag.log
  grep -A2 "bound / run" $OUT/m/$tag.log | tail -1 | sed "s/^/$tag /"
}
S="--model llama-1b --workload sharegpt --num-requests 1000"
run sg_nopad 0 $S; run sg_pad 1 $S; run sg_nopad2 0 $S; run sg_pad2 1 $S
