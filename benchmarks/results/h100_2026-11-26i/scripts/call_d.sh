#!/bin/bash
# H100: fold v3 (the GEMM adds into a private copy of the residual, made by Inductor's kernels): kernels, A/B
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/d
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
IN_PLACE=1 TORCH_LOGS="output_code" timeout 200 python3 benchmarks/scratch/s9/fusion_why.py > $OUT/d/fusion_1.log 2>&1
grep "tokens" $OUT/d/fusion_1.log
grep "\[1/0\] \[__output_code\]" $OUT/d/fusion_1.log | grep "\.run(\|extern_kernels\|torch.ops" | cut -c96-260
IN_PLACE=1 timeout 100 python3 benchmarks/scratch/s9/with_flag.py benchmarks/scratch/s9/step_kernels.py 2>&1 | grep -v Warn > $OUT/d/step_kernels_1.log
grep "== running\|memcpy\|IN_PLACE" $OUT/d/step_kernels_1.log
run() {  # tag in_place args
  local tag=$1 flag=$2; shift 2
  IN_PLACE=$flag timeout 110 python3 benchmarks/scratch/s9/with_flag.py benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/d/$tag.log
  grep -A2 "bound / run" $OUT/d/$tag.log | tail -1 | sed "s/^/$tag /"
}
L="--model llama-1b --workload sharegpt"
run new1 1 $L; run old1 0 $L; run new2 1 $L; run old2 0 $L; run new3 1 $L; run old3 0 $L
