#!/bin/bash
# H100: admission defaults swept (batch 32 / 64, max wait 16 / 48) on two saturated llama-1b workloads
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/i
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # tag admit wait args
  local tag=$1 admit=$2 wait=$3; shift 3
  ADMIT=$admit WAIT=$wait timeout 120 python3 benchmarks/scratch/s9/with_admission2.py benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/i/$tag.log
  grep -A2 "bound / run" $OUT/i/$tag.log | tail -1 | sed "s/^/$tag /"
}
A="--model llama-1b --workload alpaca --num-requests 1000"
S="--model llama-1b --workload sharegpt --num-requests 1000"
for cfg in "32 16" "64 16" "32 48" "64 48"; do
  set -- $cfg
  run alp_$1_$2 $1 $2 $A
  run sg_$1_$2 $1 $2 $S
done
