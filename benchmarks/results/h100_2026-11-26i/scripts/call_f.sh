#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/f
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
timeout 300 python3 benchmarks/scratch/s9/mixed_profile.py 2>&1 | grep -v "Warn\|warn" > $OUT/f/mixed_profile.log
head -c 20000 $OUT/f/mixed_profile.log
