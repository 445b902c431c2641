#!/bin/bash
# GPU tests of padded head dims; decode kernel timings, HEAD (old) vs working tree (new), pow2 dims
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/d
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
export PYTHONPATH=$ROOT
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_features.py tests/test_fused_decode.py "tests/test_gpu.py::test_head_dims_that_are_no_power_of_two_on_cuda" > $OUT/d/tests.log 2>&1; tail -1 $OUT/d/tests.log; grep -E "^(FAILED|ERROR)" $OUT/d/tests.log | head
V='{"base":["new",{}]}'
for r in 1 2; do
for side in old new; do
  if [ $side = old ]; then cd $ROOT/benchmarks/scratch/s14/old; export PYTHONPATH=$PWD; else cd $ROOT; export PYTHONPATH=$ROOT; fi
  ONLY=llama1b,gemma2,qwen3,qwen25,mha,llama8b VARIANTS=$V AB_NAME=ab_${side}_$r timeout 120 python3 benchmarks/scratch/s14/kernel_sweep.py 2>&1 | grep -v Warn | awk -v s=$side '{print s, $1, $7, $9}'
done; done
cd $ROOT
