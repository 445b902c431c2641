#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/head/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
timeout 60 python3 benchmarks/scratch/gemm_by_m.py 2>&1 | tee $OUT/gemm_by_m.log
timeout 150 python3 benchmarks/bench_startup.py --models llama-1b,qwen3-0.6b --modes compiled --out $OUT/startup > $OUT/startup.log 2>&1; grep -E "engine total|\|" $OUT/startup.log | head -20
(cd benchmarks && timeout 90 python3 profile_decode.py --model llama-1b --workload sharegpt --compile-decode --finished-only --until-running 24 --steps 30 --out /tmp/prof > $OUT/prof_tail24.log 2>&1)
(cd benchmarks && timeout 90 python3 profile_decode.py --model llama-1b --workload sharegpt --compile-decode --finished-only --until-running 200 --steps 30 --out /tmp/prof > $OUT/prof_200.log 2>&1)
tail -1 $OUT/prof_tail24.log $OUT/prof_200.log
