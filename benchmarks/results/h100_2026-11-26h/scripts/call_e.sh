#!/bin/bash
# the ~236 tests no session has run on a GPU host yet, in 6 parallel groups
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
mkdir -p $OUT/e
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/e/gpu.txt
for g in $TEST_GROUPS; do
  (timeout 500 python3 -m pytest -v -p no:cacheprovider -p no:logging --tb=short $(cat benchmarks/scratch/s8/notrun/g$g.txt) 2>&1 | grep -v DEBUG > $OUT/e/g$g.log) &
done
wait
for g in $TEST_GROUPS; do echo "== g$g: $(grep -c ' PASSED' $OUT/e/g$g.log) passed, $(grep -c ' SKIPPED' $OUT/e/g$g.log) skipped; $(tail -1 $OUT/e/g$g.log)"; grep -E " (FAILED|ERROR)" $OUT/e/g$g.log | grep "::" | cut -c1-160 | head -20; done
