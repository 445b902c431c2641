#!/bin/bash
# s16 call a: prefill-step host planning overlapped (commit_launched + prepare_admissions) vs 38c8ecb, alternating
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/a
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
S=$ROOT/benchmarks/scratch/s16
run() {  # side tag args
  local side=$1 tag=$2; shift 2
  if [ $side = old ]; then cd $S/old; else cd $ROOT; fi
  export PYTHONPATH=$PWD
  timeout 100 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/a/$side --no-progress > $OUT/a/${side}_$tag.log 2>&1
  grep -A3 "bound / run" $OUT/a/${side}_$tag.log | grep "^| paged" | awk -F'|' -v t="$side $tag" '{print t, "run", $3, "bound", $4, "step", $5, "prefill_s", $7, "mfu", $8}'
  grep "prefill steps of" $OUT/a/${side}_$tag.log
  cd $ROOT
}
for r in 1 2; do
  run old long_$r --model llama-1b --workload long --num-requests 64
  run new long_$r --model llama-1b --workload long --num-requests 64
done
run old sharegpt --model llama-1b --workload sharegpt
run new sharegpt --model llama-1b --workload sharegpt
run new qwen3 --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
run old qwen3 --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
cp /tmp/a/new/*long*.json $OUT/a/ 2>/dev/null
PYTHONPATH=$ROOT timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -x > $OUT/a/tests.log 2>&1; tail -3 $OUT/a/tests.log
