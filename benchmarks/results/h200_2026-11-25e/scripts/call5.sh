#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest

SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/base/hf_paged > /dev/null 2>&1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_parallel_jit.py 2>&1 | tail -3
export TRITON_CACHE_DIR=/tmp/jc/triton TORCHINDUCTOR_CACHE_DIR=/tmp/jc/inductor
python3 benchmarks/scratch/jit_log.py llama-1b > $OUT/jit_cold.log 2>&1
unset TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR
grep -h "mark\|{'kernel" $OUT/jit_cold.log
new() { python3 benchmarks/bench_startup.py --models $1 --modes compiled > $OUT/$2.log 2>&1; }
base() { (cd benchmarks/scratch/base && PYTHONPATH=$PWD python3 benchmarks/bench_startup.py --models $1 --modes compiled > $OUT/$2.log 2>&1); }
new llama-1b new_1; base llama-1b base_1; new llama-1b new_2
for f in $OUT/*_*.log; do echo "== $f"; grep -h "engine total\|phases" $f; done
