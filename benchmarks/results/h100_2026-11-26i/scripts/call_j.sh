#!/bin/bash
# H100: the table at the final library (llama-1b ShareGPT with the transformers baseline, Qwen3 sampled, long)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/j
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline 2>/dev/null | head -1
run() {  # tag args
  local tag=$1; shift
  timeout 200 python3 benchmarks/bench_generate.py "$@" --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/j/$tag.log
  grep -A5 "bound / run" $OUT/j/$tag.log | grep "^| paged\|^| generate" | sed "s/^/$tag /"
  grep "^| paged_compiled (steady\|^| paged (steady\|^| generate_batch" $OUT/j/$tag.log | sed "s/^/$tag /"
}
run llama --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 120
run qwen --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled
run long --model llama-1b --workload long --num-requests 64 --systems paged_compiled
