#!/bin/bash
# call 7: a prefill step's host time (timed, then cProfile)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/scratch/s20/prefill_host.py llama-1b > $OUT/prefill_host.log 2>&1; echo "rc $?"
grep -E "prefill step|free / total" $OUT/prefill_host.log
grep -A42 "longest CPU" $OUT/prefill_host.log | cut -c1-220
