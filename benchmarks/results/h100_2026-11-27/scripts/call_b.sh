#!/bin/bash
# the prefill graphs recorded at warm-up against lazily: fresh processes, alternating; then the GPU tests touched
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
for mode in pre lazy pre lazy; do
  timeout 100 python3 benchmarks/scratch/s13/first_pass.py $mode 120 600 2>&1 | grep -v "Warn\|warnings.warn" | tee -a $OUT/first_pass.log | grep -v "^\s*$" | cut -c1-400
done
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py > $OUT/tests_b.log 2>&1; tail -2 $OUT/tests_b.log
