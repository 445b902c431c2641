#!/bin/bash
# prefill graphs recorded at warm-up (pre) against lazily (lazy), and the lazy path of 947535d (old): fresh processes,
# alternating; then the GPU tests of ragged graphs
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 | cut -c1-60
for mode in pre lazy old pre lazy old; do
  if [ $mode = old ]; then pp=benchmarks/scratch/s13/old:$PWD; m=lazy; else pp=$PWD; m=$mode; fi
  PYTHONPATH=$pp timeout 100 python3 benchmarks/scratch/s13/first_pass.py $m 120 600 2>&1 | grep -v "Warn\|warnings.warn" | sed "s/^/[$mode] /" | tee -a $OUT/first_pass.log | grep -v "^\S* \s*$" | cut -c1-330
done
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py > $OUT/tests_c.log 2>&1; tail -2 $OUT/tests_c.log; grep -E "^(FAILED|E )" $OUT/tests_c.log | head -20
