#!/bin/bash
# call 5: the GPU memory-lifetime failure of call 4, alone and diagnosed; the two ragged-graph tests (OOM beside the
# other process in call 4) alone
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_memory_lifetime.py > $OUT/mem_alone.log 2>&1; echo "memory tests alone rc $?"; tail -2 $OUT/mem_alone.log
timeout 100 python3 benchmarks/scratch/s21/leak.py default > $OUT/leak.log 2>&1; echo "leak rc $?"; cat $OUT/leak.log | grep -v Warning | tail -30
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py -k "second_step_and_replayed or records_every_bucket" > $OUT/ragged.log 2>&1; echo "ragged rc $?"; tail -2 $OUT/ragged.log
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_beam.py tests/test_memory_lifetime.py > $OUT/beam_mem.log 2>&1; echo "beam+mem rc $?"; tail -2 $OUT/beam_mem.log
