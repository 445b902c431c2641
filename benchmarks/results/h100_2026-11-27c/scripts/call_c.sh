#!/bin/bash
# s15 call c: final prefill kernel vs d8ea477 (kernel alone, then the long-prompt workload end to end), GPU kernel tests
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/c
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
S=$ROOT/benchmarks/scratch/s15  # these scripts, as run from there
timeout 150 python3 $S/variant_sweep.py pv0,pnew > $OUT/c/sweep.log 2>&1; grep -v Warn $OUT/c/sweep.log
ONLY=long WINDOW=1000 timeout 60 python3 $S/variant_sweep.py pv0,pnew > $OUT/c/window.log 2>&1; cat $OUT/c/window.log
run() {  # side tag args
  local side=$1 tag=$2; shift 2
  if [ $side = old ]; then cd $S/old; else cd $ROOT; fi
  export PYTHONPATH=$PWD
  timeout 100 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out $OUT/c/$side --no-progress > $OUT/c/${side}_$tag.log 2>&1
  grep -A3 "bound / run" $OUT/c/${side}_$tag.log | grep "^| paged" | awk -F'|' -v t="$side $tag" '{print t, "run", $3, "bound", $4, "step", $5, "prefill_s", $7, "mfu", $8}'
  cd $ROOT
}
for r in 1 2; do
  run old long --model llama-1b --workload long --num-requests 64
  run new long --model llama-1b --workload long --num-requests 64
done
PYTHONPATH=$ROOT timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_features.py -k "cuda or whole" -x > $OUT/c/tests.log 2>&1; tail -3 $OUT/c/tests.log
rm -rf $OUT/c/old/*.png $OUT/c/new/*.png
