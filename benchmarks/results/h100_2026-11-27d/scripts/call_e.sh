#!/bin/bash
# s16 call e: start-up, HEAD against 38c8ecb (session start), alternating; GPU tests of the engine paths touched
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/e
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/s16/old/hf_paged > /dev/null 2>&1
S=$ROOT/benchmarks/scratch/s16
for r in 1 2; do
  for side in new old; do
    if [ $side = old ]; then cd $S/old; else cd $ROOT; fi
    PYTHONPATH=$PWD timeout 130 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled > $OUT/e/startup_${side}_$r.log 2>&1
    grep "engine total" $OUT/e/startup_${side}_$r.log | sed "s/^/$side $r /" | cut -c1-140
    cd $ROOT
  done
done
PYTHONPATH=$ROOT timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_host_ints.py > $OUT/e/tests.log 2>&1; tail -3 $OUT/e/tests.log
