#!/bin/bash
# H100: in-place fold v2 (residual passed whole): the step's kernels, A/B end to end on three workloads
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
mkdir -p $OUT/b
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
IN_PLACE=1 timeout 100 python3 benchmarks/scratch/s9/with_flag.py benchmarks/scratch/s9/step_kernels.py 2>&1 | grep -v Warn > $OUT/b/step_kernels_1.log
grep "== running\|memcpy\|IN_PLACE" $OUT/b/step_kernels_1.log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_sibling_linears.py 2>&1 | tail -1
run() {  # tag in_place args
  local tag=$1 flag=$2; shift 2
  IN_PLACE=$flag timeout 110 python3 benchmarks/scratch/s9/with_flag.py benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/b/$tag.log
  grep -A2 "bound / run" $OUT/b/$tag.log | tail -1 | sed "s/^/$tag /"
}
L="--model llama-1b --workload sharegpt"
run new1 1 $L; run old1 0 $L; run new2 1 $L; run old2 0 $L; run new3 1 $L; run old3 0 $L
Q="--model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95"
run qnew 1 $Q; run qold 0 $Q
G="--model llama-1b --workload long --num-requests 64"
run lnew 1 $G; run lold 0 $G
