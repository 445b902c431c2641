#!/bin/bash
# call 7: start-up, the final tree against 3c871fc (before the decode kernel's prefetch rule), fixed pool, alternating
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s19/old2/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
timeout 130 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 3 --out $OUT/new > $OUT/new.log 2>&1; echo "new rc $?"
tail -1 $OUT/new.log
(cd benchmarks/scratch/s19/old2 && PYTHONPATH=$PWD timeout 130 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 3 --out $OUT/old > $OUT/old.log 2>&1; echo "old rc $?")
tail -1 $OUT/old.log
