#!/bin/bash
# final library: GPU tests of ragged graphs; the table
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
mkdir -p $OUT/f
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py > $OUT/f/tests.log 2>&1; tail -1 $OUT/f/tests.log; grep -E "^(FAILED|E )" $OUT/f/tests.log | head
run() {  # tag args
  local tag=$1; shift
  timeout 200 python3 benchmarks/bench_generate.py "$@" --out $OUT/f --no-progress 2>&1 | grep -v Warn > $OUT/f/$tag.log
  grep "^bound" $OUT/f/$tag.log | sed "s/^/$tag /"
  grep -A5 "bound / run" $OUT/f/$tag.log | grep "^| paged\|^| generate" | sed "s/^/$tag /"
}
run llama --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 120
run qwen --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled
run long --model llama-1b --workload long --num-requests 64 --systems paged_compiled
rm -f $OUT/f/*.png
