#!/bin/bash
export PYTHONUNBUFFERED=1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/triton hf_paged > /dev/null 2>&1
export PYTHONPATH=$PWD
timeout 560 python3 benchmarks/scratch/sweep_grouped.py $OUT 2>&1 | grep -v Warn | tee $OUT/sweep.log | grep -v "^ "
