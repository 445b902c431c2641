#!/bin/bash
# H100: the compiled step's kernels in order; cuBLASLt for the GEMMs, end to end
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/b
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
timeout 150 python3 benchmarks/scratch/s8/step_kernels.py 2>&1 | grep -v Warn > $OUT/b/step_kernels.log
cp $OUT/step_kernels.json $OUT/b/ 2>/dev/null; rm -f $OUT/step_kernels.json
head -60 $OUT/b/step_kernels.log
run() {  # tag args...
  local tag=$1; shift
  timeout 120 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/b/$tag.log
  grep -A2 "bound / run" $OUT/b/$tag.log | tail -1 | sed "s/^/$tag /"
}
run base1 --model llama-1b --workload sharegpt
TORCH_BLAS_PREFER_CUBLASLT=1 run lt1 --model llama-1b --workload sharegpt
run base2 --model llama-1b --workload sharegpt
TORCH_BLAS_PREFER_CUBLASLT=1 run lt2 --model llama-1b --workload sharegpt
