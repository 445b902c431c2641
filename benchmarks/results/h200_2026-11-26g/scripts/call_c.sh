#!/bin/bash
# fused gated MLP: the dispatcher's rule vs unfused on 7 MLP shapes; GPU tests; e2e llama-1b ShareGPT head vs new
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/c
nvidia-smi --query-gpu=name --format=csv | tee $OUT/c/gpu.txt
OUT=$OUT/c timeout 200 python3 benchmarks/scratch/s7/gated_ab.py 2>&1 | grep -v Warn | tee $OUT/c/gated_ab.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gated_mlp.py tests/test_sibling_linears.py tests/test_compile_decode.py 2>&1 | tail -3 | tee $OUT/c/tests.log
run() {  # tag dir args...
  local tag=$1 dir=$2; shift 2
  (cd $dir && PYTHONPATH=$PWD timeout 100 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/c/$tag.log)
  grep -A2 "bound / run" $OUT/c/$tag.log | tail -1 | sed "s/^/$tag /"
}
for i in 1 2; do
  run llama_new$i . --model llama-1b --workload sharegpt
  run llama_head$i benchmarks/scratch/head --model llama-1b --workload sharegpt
done
