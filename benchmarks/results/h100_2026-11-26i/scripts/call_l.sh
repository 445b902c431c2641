#!/bin/bash
# H100: ragged steps padded to a token grid (cuBLAS heuristic cache) against unpadded
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
mkdir -p $OUT/l
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/scratch/s9/ttft_probe.py 2>&1 | grep "pad=" | tee $OUT/l/ttft_probe.log
run() {  # tag pad args
  local tag=$1 pad=$2; shift 2
  PAD=$pad timeout 120 python3 benchmarks/scratch/s9/with_pad.py benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/l/$tag.log
  grep -A2 "bound / run" $OUT/l/$tag.log | tail -1 | sed "s/^/$tag /"
}
A="--model llama-1b --workload alpaca --num-requests 1000"
run alp_pad 1 $A; run alp_nopad 0 $A; run alp_pad2 1 $A; run alp_nopad2 0 $A
S="--model llama-1b --workload sharegpt --num-requests 1000"
run sg_pad 1 $S; run sg_nopad 0 $S
run sg256_pad 1 --model llama-1b --workload sharegpt
run long_pad 1 --model llama-1b --workload long --num-requests 64
run long_nopad 0 --model llama-1b --workload long --num-requests 64
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_padding.py tests/test_admission.py 2>&1 | tail -1
