#!/bin/bash
# H100: shapes and workloads the issue does not name, compiled engine, fraction of the bound (library 60c93b4)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/e
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # tag args
  local tag=$1; shift
  timeout 170 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/e/$tag.log
  grep -A2 "bound / run" $OUT/e/$tag.log | tail -1 | sed "s/^/$tag /"
  grep "in steps outside" $OUT/e/$tag.log | sed "s/^/$tag /"
}
run qwen25_greedy --model qwen2.5-0.5b --workload sharegpt
run qwen3_greedy --model qwen3-0.6b --workload sharegpt
run llama1b_sampled --model llama-1b --workload sharegpt --temperature 0.8 --top-p 0.95
run llama1b_alpaca --model llama-1b --workload alpaca --num-requests 1000
run llama8b_greedy --model llama-8b --workload sharegpt
