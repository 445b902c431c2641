#!/bin/bash
# e2e, head (8a81410) and new in one call: llama-1b ShareGPT greedy x2, Qwen3 shape sampled x1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/e
run() {  # tag dir args...
  local tag=$1 dir=$2; shift 2
  (cd $dir && PYTHONPATH=$PWD python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/e/$tag.log)
  grep -A2 "bound / run" $OUT/e/$tag.log | tail -1 | sed "s/^/$tag /"
}
for i in 1 2; do
  run llama_new$i . --model llama-1b --workload sharegpt
  run llama_head$i benchmarks/scratch/head --model llama-1b --workload sharegpt
done
run qwen_new . --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95
run qwen_head benchmarks/scratch/head --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95
