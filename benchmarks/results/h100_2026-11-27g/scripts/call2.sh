#!/bin/bash
# call 2: start-up A/B with the engine's automatic pool sizing (new first), then the GPU tests of the warm-up path
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s19/old/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
mkdir -p $OUT/startup
PYTHONPATH=$ROOT timeout 200 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 4 --kv-cache-memory auto --out $OUT/startup/new_auto > $OUT/startup/new_auto.log 2>&1; echo "new_auto rc $?"
tail -3 $OUT/startup/new_auto.log
(cd benchmarks/scratch/s19/old && PYTHONPATH=$PWD timeout 200 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 4 --kv-cache-memory auto --out $OUT/startup/old_auto > $OUT/startup/old_auto.log 2>&1; echo "old_auto rc $?")
tail -3 $OUT/startup/old_auto.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_parallel_jit.py tests/test_compile_default.py -x > $OUT/tests.log 2>&1; echo "tests rc $?"
tail -5 $OUT/tests.log
