#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "default_engine or cannot_be_captured" > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log; grep -B5 Error $OUT/tests.log | head -30
timeout 200 python3 benchmarks/bench_startup.py --models llama-8b --modes compiled > $OUT/startup_8b.log 2>&1; grep "engine total" $OUT/startup_8b.log
timeout 250 python3 benchmarks/bench_beam.py --model llama-8b --beams 4 --systems paged_compiled,transformers --out $OUT > $OUT/beam.log 2>&1; grep "^|" $OUT/beam.log | tail -4
