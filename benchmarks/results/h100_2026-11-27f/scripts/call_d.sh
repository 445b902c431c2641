#!/bin/bash
# s18 call d: the GPU tests of the changed paths; then a warm start with automatic pool sizing, sampled (new tree)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
mkdir -p $OUT/d
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "graph or recording or captured" > $OUT/d/tests_gpu.log 2>&1; tail -2 $OUT/d/tests_gpu.log
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_parallel_jit.py tests/test_pipelined_decode.py > $OUT/d/tests_jit.log 2>&1; tail -2 $OUT/d/tests_jit.log
export TORCHINDUCTOR_CACHE_DIR=/tmp/cd/inductor TRITON_CACHE_DIR=/tmp/cd/triton
timeout 60 python3 benchmarks/scratch/s18/warm_sample.py > $OUT/d/sample_cold.txt 2>&1
timeout 40 python3 benchmarks/scratch/s18/warm_sample.py > $OUT/d/sample_warm.txt 2>&1
grep -E "capture_retries|construct|^    [0-9.]+  (triton|rest|inductor|dynamo|import torch._ind)" $OUT/d/sample_warm.txt | head -12
grep -E "threading.py:join|'warm_up', 'rest'" $OUT/d/sample_warm.txt | head -3
