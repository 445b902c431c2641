#!/bin/bash
# H100: GPU tests at the commit; the table; steady arrivals at 120 requests/s, ragged graphs on/off
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/c
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf --tb=short tests/test_ragged_graphs.py \
  tests/test_gpu.py > $OUT/c/tests.log 2>&1
grep -E "passed|failed|^E |^FAILED" $OUT/c/tests.log | head -20
run() {  # tag args
  local tag=$1; shift
  timeout 200 python3 benchmarks/bench_generate.py "$@" --out $OUT/c --no-progress 2>&1 | grep -v Warn > $OUT/c/$tag.log
  grep "^bound" $OUT/c/$tag.log | sed "s/^/$tag /"
  grep -A5 "bound / run" $OUT/c/$tag.log | grep "^| paged\|^| generate" | sed "s/^/$tag /"
  grep "^| paged_compiled (steady\|^| paged (steady\|^| generate_batch" $OUT/c/$tag.log | sed "s/^/$tag /"
}
run llama --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 120
run qwen --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled
run long --model llama-1b --workload long --num-requests 64 --systems paged_compiled
timeout 120 python3 benchmarks/scratch/s11/arrivals.py 120 600 2>&1 | grep -v Warn > $OUT/c/arrivals120.log; tail -5 $OUT/c/arrivals120.log
rm -f $OUT/c/*.png
