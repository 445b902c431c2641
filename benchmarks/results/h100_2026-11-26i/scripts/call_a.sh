#!/bin/bash
# H100: in-place residual fold A/B (end to end + the step's kernels), GPU tests of the compiled step
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
mkdir -p $OUT/a
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_sibling_linears.py tests/test_compile_decode.py tests/test_gpu.py tests/test_compile_default.py 2>&1 | tail -4 > $OUT/a/tests.log
cat $OUT/a/tests.log
run() {  # tag in_place
  IN_PLACE=$2 timeout 110 python3 benchmarks/scratch/s9/with_flag.py benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e_$1 --no-progress 2>&1 | grep -v Warn > $OUT/a/$1.log
  grep -A2 "bound / run" $OUT/a/$1.log | tail -1 | sed "s/^/$1 /"; grep IN_PLACE_RESIDUAL $OUT/a/$1.log
}
run new1 1; run old1 0; run new2 1; run old2 0; run new3 1; run old3 0
for f in 1 0; do
  IN_PLACE=$f timeout 100 python3 benchmarks/scratch/s9/with_flag.py benchmarks/scratch/s9/step_kernels.py 2>&1 | grep -v Warn > $OUT/a/step_kernels_$f.log
  grep "== running\|memcpy\|IN_PLACE" $OUT/a/step_kernels_$f.log
done
