#!/bin/bash
# one capture stream: prefill graphs at warm-up (pre) / lazily (lazy) against 947535d's lazy path (old, run from a
# copy of that library); memory by pool; then the GPU tests of graphs
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
S=$PWD/benchmarks/scratch/s13
for mode in pre old lazy pre old lazy; do
  if [ $mode = old ]; then dir=$S/old; m=lazy; else dir=$PWD; m=$mode; fi
  (cd $dir && PYTHONPATH=$dir timeout 100 python3 $S/first_pass.py $m 120 600 2>&1) | grep -v "Warn\|warnings.warn" | sed "s/^/[$mode] /" | tee -a $OUT/first_pass.log | grep -v "^\S* \s*$" | cut -c1-300
done
PYTHONPATH=$PWD timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py tests/test_gpu.py -k "graph or ragged or capture" > $OUT/tests_d.log 2>&1; tail -2 $OUT/tests_d.log; grep -E "^(FAILED|E )" $OUT/tests_d.log | head -20
