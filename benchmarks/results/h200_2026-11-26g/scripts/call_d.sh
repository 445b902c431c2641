#!/bin/bash
# the three GPU failures of call c, on head and new (tracebacks); tile sweep of the fused gated kernel
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/d
T="tests/test_compile_decode.py"
timeout 150 python3 -m pytest -q -p no:cacheprovider $T -x --tb=long 2>&1 | grep -v Warn | tail -80 > $OUT/d/tests_new.log
tail -3 $OUT/d/tests_new.log
(cd benchmarks/scratch/head && PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_compile_decode.py --tb=line 2>&1 | grep -v Warn | tail -8 > $OUT/d/tests_head.log)
tail -5 $OUT/d/tests_head.log
OUT=$OUT/d timeout 250 python3 benchmarks/scratch/s7/gated_sweep2.py 2>&1 | grep -v Warn | tee $OUT/d/sweep2.log
