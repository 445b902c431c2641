#!/bin/bash
# call 3: Qwen3-0.6B shape sampled, new (d8844bf) against old (78d6673), alternating: is the slower prefill the tree's?
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/scratch/s22
t0=$(date +%s)
ARGS="--model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled --no-progress"
bench() { # tag dir
  if [ "$2" = "." ]; then timeout 100 python3 benchmarks/bench_generate.py $ARGS --out $OUT/$1 > $OUT/$1.log 2>&1; echo "$1 rc $? at $(( $(date +%s) - t0 )) s";
  else (cd $S/$2 && PYTHONPATH=$PWD timeout 100 python3 benchmarks/bench_generate.py $ARGS --out $OUT/$1 > $OUT/$1.log 2>&1; echo "$1 rc $? at $(( $(date +%s) - t0 )) s"); fi
  grep -A2 "^| system | run s" $OUT/$1.log | tail -1; grep "prefill steps of" $OUT/$1.log
}
bench qnew1 .
bench qold1 old
bench qnew2 .
bench qold2 old
rm -f $OUT/*/*.png
