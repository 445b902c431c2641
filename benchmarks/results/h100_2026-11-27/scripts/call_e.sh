#!/bin/bash
# largest bucket first or not (lazy, ascending), then the GPU tests of graphs, compile, pipelined decode
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
for first in 1 0 1 0; do
  FIRST=$first timeout 90 python3 benchmarks/scratch/s13/ascending.py 2>&1 | grep "^FIRST" | tee -a $OUT/ascending.log
done
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py tests/test_recording.py tests/test_gpu.py tests/test_compile_default.py tests/test_pipelined_decode.py > $OUT/tests_e.log 2>&1; tail -2 $OUT/tests_e.log; grep -E "^(FAILED|E )" $OUT/tests_e.log | head -20
