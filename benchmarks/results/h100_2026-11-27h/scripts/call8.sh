#!/bin/bash
# call 8: the output projection of ragged steps at decode buckets: prefill host time, end to end A/B against HEAD (2101087)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s20/old > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 benchmarks/scratch/s20/prefill_host.py llama-1b > $OUT/prefill_host.log 2>&1; echo "probe rc $?"
grep -E "prefill step" $OUT/prefill_host.log
grep -A6 "longest CPU" $OUT/prefill_host.log | cut -c1-200
run() {  # tree label args...
  local tree=$1 label=$2; shift 2
  if [ $tree = old ]; then
    (cd benchmarks/scratch/s20/old && PYTHONPATH=$PWD timeout 120 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --no-progress --out $OUT/$label > $OUT/$label.log 2>&1); echo "$label rc $?"
  else
    timeout 120 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --no-progress --out $OUT/$label > $OUT/$label.log 2>&1; echo "$label rc $?"
  fi
  grep -A2 "^| system | run s" $OUT/$label.log | tail -1; grep "prefill steps of" $OUT/$label.log
}
for r in a b; do
run new llama_new_$r --model llama-1b --workload sharegpt
run old llama_old_$r --model llama-1b --workload sharegpt
done
run new qwen3_new --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95
run old qwen3_old --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95
