#!/bin/bash
# s16 call b: + step inputs through array buffers (host_ints) vs 38c8ecb, alternating; host profile; GPU tests
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/b
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
S=$ROOT/benchmarks/scratch/s16
run() {  # side tag args
  local side=$1 tag=$2; shift 2
  if [ $side = old ]; then cd $S/old; else cd $ROOT; fi
  export PYTHONPATH=$PWD
  timeout 100 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/b/$side --no-progress > /tmp/b_${side}_$tag.log 2>&1
  grep -A3 "bound / run" /tmp/b_${side}_$tag.log | grep "^| paged" | awk -F'|' -v t="$side $tag" '{print t, "run", $3, "bound", $4, "step", $5, "prefill_s", $7, "mfu", $8}'
  grep "prefill steps of" /tmp/b_${side}_$tag.log
  cd $ROOT
}
{
for r in 1 2; do
  run new long_$r --model llama-1b --workload long --num-requests 64
  run old long_$r --model llama-1b --workload long --num-requests 64
done
for r in 1 2; do
  run new sharegpt_$r --model llama-1b --workload sharegpt
  run old sharegpt_$r --model llama-1b --workload sharegpt
done
} | tee $OUT/b/summary.txt
cp /tmp/b/new/generate_llama-1b_long_64.json $OUT/b/new_long.json
cp /tmp/b/old/generate_llama-1b_long_64.json $OUT/b/old_long.json
PYTHONPATH=$ROOT timeout 70 python3 $S/prefill_host.py long > $OUT/b/host_long.log 2>&1; grep "step walls" $OUT/b/host_long.log
PYTHONPATH=$ROOT timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_host_ints.py tests/test_gpu.py -x > $OUT/b/tests.log 2>&1; tail -3 $OUT/b/tests.log
