#!/bin/bash
# tracebacks of the three test_compile_decode failures seen on the H200 (torch 2.11), head tree = this tree
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/e
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee $OUT/e/versions.txt
env | grep -i "torch\|triton\|cuda\|python" | sort > $OUT/e/env.txt
timeout 250 python3 -m pytest -q -p no:cacheprovider -p no:logging "tests/test_compile_decode.py::test_prefill_steps_run_the_compiled_layers_and_compile_nothing_more" tests/test_compile_decode.py::test_a_dropped_engine_is_freed_without_the_cycle_collector --tb=short 2>&1 | grep -v "DEBUG\|^\s*$" | tail -120 > $OUT/e/tb.log
tail -60 $OUT/e/tb.log
