#!/bin/bash
# H100: batched admissions (auto = max_num_seqs // 8 with graphs) against admission at once, same process kind
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
mkdir -p $OUT/h
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # tag admit args
  local tag=$1 admit=$2; shift 2
  ADMIT=$admit timeout 150 python3 benchmarks/scratch/s9/with_admission.py benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/h/$tag.log
  grep -A2 "bound / run" $OUT/h/$tag.log | tail -1 | sed "s/^/$tag /"
}
A="--model llama-1b --workload alpaca --num-requests 1000"
run alp_auto auto $A; run alp_one 1 $A; run alp_auto2 auto $A; run alp_one2 1 $A
S="--model llama-1b --workload sharegpt --num-requests 1000"
run sg1000_auto auto $S; run sg1000_one 1 $S
run sg256_auto auto --model llama-1b --workload sharegpt
Q="--model qwen3-0.6b --workload uniform --num-requests 512 --temperature 0.6 --top-p 0.95"
run q512_auto auto $Q; run q512_one 1 $Q
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_admission.py tests/test_pipelined_decode.py 2>&1 | tail -1
