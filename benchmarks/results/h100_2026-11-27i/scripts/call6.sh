#!/bin/bash
# call 6: the dropped-model test: cause (leak.py at HEAD, cuBLAS workspaces cleared at the end), the new test on the
# old library (78d6673) and on the new tree; the recording tests with two engines
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
S=benchmarks/scratch/s21
(cd $S/old && PYTHONPATH=$PWD timeout 90 python3 ../leak.py old 2>&1 | grep -v -i warn | grep -E "^old" ); echo "leak old rc $?"
mkdir -p $S/old/tests && cp tests/conftest.py $S/old/tests/ && cp $S/test_memory_lifetime_new.py $S/old/tests/test_memory_lifetime.py
(cd $S/old && PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_memory_lifetime.py -k "dropped_model or lent" 2>&1 | tail -3); echo "new test on old library rc $?"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_memory_lifetime.py -k "dropped_model or lent or side_by_side" 2>&1 | tail -2; echo "memory tests on new tree"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ragged_graphs.py -k "another_serves or second_step or records_every_bucket or memory_of_the_largest" 2>&1 | tail -2; echo "ragged recording tests on new tree"
