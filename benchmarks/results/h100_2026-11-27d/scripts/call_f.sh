#!/bin/bash
# s16 call f: Qwen3 sampled with top-k 50 added (transformers' generate() default), against top-p alone, at 7a66e8f
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
mkdir -p $OUT/f
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
for k in 50 0; do
  timeout 150 python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95 --top-k $k --systems paged_compiled --out /tmp/f --no-progress > $OUT/f/qwen3_k$k.log 2>&1
  grep -A3 "bound / run" $OUT/f/qwen3_k$k.log | grep "^| paged" | sed "s/^/top-k $k /"
done
