#!/bin/bash
# s16 call d: the final library (41bd186 + DRAW_FIRST_MIN_P in the tree): sampler at p 0.8 / 0.5; the table; start-up
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
mkdir -p $OUT/d
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
S=benchmarks/scratch/s16
SETS=t0.7-p0.8,t0.7-p0.5 timeout 90 python3 $S/sampler_ab.py > $OUT/d/sampler_p.log 2>&1; grep "^|" $OUT/d/sampler_p.log
run() {  # tag args
  local tag=$1; shift
  timeout 200 python3 benchmarks/bench_generate.py "$@" --out /tmp/d --no-progress 2>&1 | grep -v Warn > $OUT/d/$tag.log
  grep "^bound" $OUT/d/$tag.log | sed "s/^/$tag /"
  grep -A5 "bound / run" $OUT/d/$tag.log | grep "^| paged\|^| generate" | sed "s/^/$tag /"
  grep "x generate_batch" -A4 $OUT/d/$tag.log | grep "^| " | sed "s/^/$tag /"
}
run llama --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 120
run qwen --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled,paged
run long --model llama-1b --workload long --num-requests 64 --systems paged_compiled
cp /tmp/d/*.json $OUT/d/ 2>/dev/null
timeout 200 python3 benchmarks/bench_startup.py --models llama-1b,qwen3-0.6b --modes compiled > $OUT/d/startup.log 2>&1; grep "^|" $OUT/d/startup.log | tail -6
