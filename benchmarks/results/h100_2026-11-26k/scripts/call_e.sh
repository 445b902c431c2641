#!/bin/bash
# H100: GPU tests at the final library code
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/e
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
timeout 420 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf --tb=short tests/test_ragged_graphs.py \
  tests/test_gpu.py tests/test_pipelined_decode.py tests/test_admission.py > $OUT/e/tests.log 2>&1
grep -E "passed|failed|^E |^FAILED" $OUT/e/tests.log | head -20
