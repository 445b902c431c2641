#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/g
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
PREFILL=1 timeout 200 python3 benchmarks/scratch/s9/mixed_cprofile.py 2>&1 | grep -v "Warn\|warn" > $OUT/g/cprofile_compiled_prefill.log
PREFILL=0 timeout 200 python3 benchmarks/scratch/s9/mixed_cprofile.py 2>&1 | grep -v "Warn\|warn" > $OUT/g/cprofile_eager_prefill.log
grep "60 steps" $OUT/g/*.log
timeout 200 python3 benchmarks/bench_generate.py --model llama-1b --workload alpaca --num-requests 1000 --systems paged_compiled,paged_compiled_eager_prefill --out /tmp/e2e_alp --no-progress 2>&1 | grep -v Warn > $OUT/g/alpaca_ab.log
grep -A3 "bound / run" $OUT/g/alpaca_ab.log
