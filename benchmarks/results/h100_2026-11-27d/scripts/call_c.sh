#!/bin/bash
# s16 call c: the sampler's draw-first path: kernel A/B, Qwen3 sampled end to end vs HEAD (no draw-first), GPU tests
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/c
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
S=$ROOT/benchmarks/scratch/s16
PYTHONPATH=$ROOT timeout 150 python3 $S/sampler_ab.py > $OUT/c/sampler_ab.log 2>&1; grep -v Warn $OUT/c/sampler_ab.log | head -90
run() {  # side tag args
  local side=$1 tag=$2; shift 2
  if [ $side = old ]; then cd $S/old; else cd $ROOT; fi
  export PYTHONPATH=$PWD
  timeout 100 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/c/$side --no-progress > $OUT/c/${side}_$tag.log 2>&1
  grep -A3 "bound / run" $OUT/c/${side}_$tag.log | grep "^| paged" | awk -F'|' -v t="$side $tag" '{print t, "run", $3, "bound", $4, "step", $5, "prefill_s", $7, "mfu", $8}'
  cd $ROOT
}
for r in 1 2; do
  run new qwen3_$r --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
  run old qwen3_$r --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
done
PYTHONPATH=$ROOT timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sampling.py -x > $OUT/c/tests.log 2>&1; tail -3 $OUT/c/tests.log
