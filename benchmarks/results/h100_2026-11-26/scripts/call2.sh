#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/base/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sampling.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log
new() { python3 benchmarks/bench_startup.py --models $1 --modes $3 > $OUT/$2.log 2>&1; }
base() { (cd benchmarks/scratch/base && PYTHONPATH=$PWD python3 benchmarks/bench_startup.py --models $1 --modes compiled > $OUT/$2.log 2>&1); }
new llama-1b new_llama compiled; base llama-1b base_llama; new qwen3-0.6b new_qwen compiled; new llama-1b new_llama_eager eager
for f in $OUT/*_*.log; do echo "== $f"; grep -h "engine total" $f; done
(cd benchmarks && python3 profile_decode.py --model llama-1b --workload sharegpt --compile-decode --finished-only --until-running 24 --steps 30 --out /tmp/prof > $OUT/prof_tail24.log 2>&1)
(cd benchmarks && python3 profile_decode.py --model llama-1b --workload sharegpt --compile-decode --finished-only --until-running 200 --steps 30 --out /tmp/prof > $OUT/prof_200.log 2>&1)
tail -3 $OUT/prof_tail24.log $OUT/prof_200.log
