#!/bin/bash
# A/B of engine start-up: new tree (repo root) vs base tree (benchmarks/scratch/base, commit 014360a), ABBA order.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
git rev-parse HEAD > $OUT/commit.txt 2>/dev/null
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/base/hf_paged > /dev/null 2>&1
t0=$(date +%s)
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_parallel_jit.py tests/test_sibling_linears.py tests/test_gpu.py > $OUT/pytest.log 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/pytest.log
new() { python3 benchmarks/bench_startup.py --models $1 --modes compiled > $OUT/$2.log 2>&1; }
base() { (cd benchmarks/scratch/base && PYTHONPATH=$PWD python3 benchmarks/bench_startup.py --models $1 --modes compiled > $OUT/$2.log 2>&1); }
new llama-1b new_1; base llama-1b base_1; base qwen3-0.6b base_qwen; new qwen3-0.6b new_qwen; new llama-1b new_2
for f in $OUT/*_*.log; do echo "== $f"; grep -h "engine total\|phases" $f; done
tail -3 $OUT/pytest.log
