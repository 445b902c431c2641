#!/bin/bash
# s15 call d: GPU tests touching the prefill kernel; ShareGPT and Qwen3 end to end old vs new; prefill host profile
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/d
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
S=$ROOT/benchmarks/scratch/s15  # these scripts, as run from there
PYTHONPATH=$ROOT timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py tests/test_gpu.py -x > $OUT/d/tests.log 2>&1; tail -3 $OUT/d/tests.log
run() {  # side tag args
  local side=$1 tag=$2; shift 2
  if [ $side = old ]; then cd $S/old; else cd $ROOT; fi
  export PYTHONPATH=$PWD
  timeout 100 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out $OUT/d/$side --no-progress > $OUT/d/${side}_$tag.log 2>&1
  grep -A3 "bound / run" $OUT/d/${side}_$tag.log | grep "^| paged" | awk -F'|' -v t="$side $tag" '{print t, "run", $3, "bound", $4, "step", $5, "prefill_s", $7, "mfu", $8}'
  cd $ROOT
}
run old sharegpt --model llama-1b --workload sharegpt
run new sharegpt --model llama-1b --workload sharegpt
run old qwen3 --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
run new qwen3 --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
rm -rf $OUT/d/old/*.png $OUT/d/new/*.png
timeout 80 python3 $S/prefill_host.py long > $OUT/d/host_long.log 2>&1; grep "step walls" $OUT/d/host_long.log
