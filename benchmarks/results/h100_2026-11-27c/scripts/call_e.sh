#!/bin/bash
# s15 call e: mid-length prompts kernel A/B; ShareGPT and Qwen3 end to end, old/new alternating; GPU tests
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/e
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
S=$ROOT/benchmarks/scratch/s15  # these scripts, as run from there
ONLY=mid,short timeout 60 python3 $S/variant_sweep.py pv0,pnew > $OUT/e/mid.log 2>&1; cat $OUT/e/mid.log
run() {  # side tag args
  local side=$1 tag=$2; shift 2
  if [ $side = old ]; then cd $S/old; else cd $ROOT; fi
  export PYTHONPATH=$PWD
  timeout 100 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e/$side --no-progress > $OUT/e/${side}_$tag.log 2>&1
  grep -A3 "bound / run" $OUT/e/${side}_$tag.log | grep "^| paged" | awk -F'|' -v t="$side $tag" '{print t, "run", $3, "bound", $4, "step", $5, "prefill_s", $7, "mfu", $8}'
  cd $ROOT
}
for r in 1 2; do
  run old qwen3_$r --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
  run new qwen3_$r --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
  run old sharegpt_$r --model llama-1b --workload sharegpt
  run new sharegpt_$r --model llama-1b --workload sharegpt
done
PYTHONPATH=$ROOT timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py tests/test_gpu.py > $OUT/e/tests.log 2>&1; tail -3 $OUT/e/tests.log
