#!/bin/bash
# GPU tests after the shared normalisation (prefill + decode), and the decode kernel's time
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/j
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_features.py tests/test_fused_decode.py tests/test_parallel_jit.py tests/test_gpu.py 2>&1 | tail -3 | tee $OUT/j/tests.log
VARIANTS='{"new": ["new", {}]}' timeout 60 python3 benchmarks/scratch/s6/kernel_ab.py 2>&1 | grep -v Warn | head -2 | tee $OUT/j/kernel.log
