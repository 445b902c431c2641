#!/bin/bash
# prefill tile table: HEAD (297e9c4, old) vs working tree (new), end to end, alternating
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/h
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
run() {  # side tag args
  local side=$1 tag=$2; shift 2
  if [ $side = old ]; then cd $ROOT/benchmarks/scratch/s14/old; else cd $ROOT; fi
  export PYTHONPATH=$PWD
  timeout 170 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --out $OUT/h/$side --no-progress > $OUT/h/${side}_$tag.log 2>&1
  grep -A3 "bound / run" $OUT/h/${side}_$tag.log | grep "^| paged" | awk -F'|' -v t="$side $tag" '{print t, "run", $3, "bound", $4, "step", $5, "prefill_s", $7, "mfu", $8}'
  cd $ROOT
}
for r in 1 2; do
  run old long --model llama-1b --workload long --num-requests 64
  run new long --model llama-1b --workload long --num-requests 64
done
run old gemma2 --model gemma2-2b --workload sharegpt
run new gemma2 --model gemma2-2b --workload sharegpt
run old qwen3 --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
run new qwen3 --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
rm -rf $OUT/h/old $OUT/h/new/*.png
