#!/bin/bash
# call 6: the final tree: start-up (fixed pool, three warm starts), then the GPU tests of the warm-up, pipelined
# decode and compiled default, then test_gpu.py
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 3 --out $OUT/startup > $OUT/startup.log 2>&1; echo "startup rc $?"
tail -3 $OUT/startup.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_parallel_jit.py tests/test_pipelined_decode.py tests/test_compile_default.py > $OUT/tests_a.log 2>&1; echo "tests_a rc $?"
tail -2 $OUT/tests_a.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > $OUT/tests_gpu.log 2>&1; echo "tests_gpu rc $?"
tail -2 $OUT/tests_gpu.log
