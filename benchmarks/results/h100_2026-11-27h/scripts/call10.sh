#!/bin/bash
# call 10: the long-prompt workload, 6cac19d's tree against 2101087's, alternating
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s20/old > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
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
run new long_new_$r --model llama-1b --workload long --num-requests 64
run old long_old_$r --model llama-1b --workload long --num-requests 64
done
