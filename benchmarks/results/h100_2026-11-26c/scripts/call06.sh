#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
export PYTHONPATH=$PWD
timeout 100 python3 benchmarks/scratch/first_steps.py $OUT > $OUT/first_steps.log 2>&1; grep "===" $OUT/first_steps.log
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_decode_batch.py tests/test_fused_decode.py tests/test_pipelined_decode.py tests/test_sibling_linears.py > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log; grep -E "FAIL|Error" $OUT/tests.log | head
