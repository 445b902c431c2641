#!/bin/bash
# call 4: the GPU test files the last session's 330 s limit cut or did not reach, at HEAD (78d6673), two processes
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
timeout 470 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py tests/test_ragged_padding.py tests/test_engine_prefix_cache.py > $OUT/tests_a.log 2>&1 &
timeout 470 python3 -m pytest -q -p no:cacheprovider tests/test_beam.py tests/test_memory_lifetime.py tests/test_host_ints.py tests/test_argmax.py tests/test_sampling_select.py tests/test_parallel_jit.py > $OUT/tests_b.log 2>&1 &
wait
echo "done in $(( $(date +%s) - start )) s"
tail -3 $OUT/tests_a.log; tail -3 $OUT/tests_b.log
grep -E "^(FAILED|ERROR)" $OUT/tests_a.log $OUT/tests_b.log | head -20
