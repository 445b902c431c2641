#!/bin/bash
# call 11: GPU tests touching prefill steps, on the final tree
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu.py tests/test_ragged_graphs.py tests/test_engine_prefix_cache.py tests/test_ragged_padding.py tests/test_beam.py > $OUT/tests.log 2>&1; echo "tests rc $?"
tail -5 $OUT/tests.log
