#!/bin/bash
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/h
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_fused_decode.py tests/test_parallel_jit.py tests/test_kernel_features.py tests/test_kernels.py tests/test_compile_default.py 2>&1 | tail -3 | tee $OUT/h/tests.log
VARIANTS='{"new": ["new", {}]}' timeout 100 python3 benchmarks/scratch/s6/kernel_ab.py 2>&1 | grep -v Warn | head -3 | tee $OUT/h/kernel.log
