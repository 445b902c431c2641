#!/bin/bash
# shapes beyond llama: ShareGPT-like 256 greedy, compiled and eager, fraction of each one's bound
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
mkdir -p $OUT/a
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # tag args
  local tag=$1; shift
  local t0=$(date +%s)
  timeout ${TMO:-170} python3 benchmarks/bench_generate.py "$@" --out $OUT/a --no-progress > $OUT/a/$tag.log 2>&1
  echo "$tag rc=$? $(( $(date +%s) - t0 ))s"
  grep "^bound" $OUT/a/$tag.log | sed "s/^/$tag /"
  grep -A5 "bound / run" $OUT/a/$tag.log | grep "^| paged" | sed "s/^/$tag /"
  grep -E "Error|error" $OUT/a/$tag.log | grep -v Warn | head -3
}
for m in $MODELS; do run $m --model $m --workload sharegpt --systems ${SYSTEMS:-paged_compiled,paged}; done
rm -f $OUT/a/*.png
