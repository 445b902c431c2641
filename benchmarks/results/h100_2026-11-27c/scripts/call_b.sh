#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/b
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
S=$ROOT/benchmarks/scratch/s15  # these scripts, as run from there
timeout 330 python3 $S/variant_sweep.py pv0,pv1,pv2,pv3_4,pv4_4 > $OUT/b/sweep.log 2>&1; cat $OUT/b/sweep.log | grep -v Warn
ONLY=short timeout 100 python3 $S/variant_sweep.py pv0,pv3_2,pv3_8,pv4_2,pv4_8 > $OUT/b/short.log 2>&1; cat $OUT/b/short.log
ONLY=long WINDOW=1000 timeout 80 python3 $S/variant_sweep.py pv0,pv1,pv3_4 > $OUT/b/window.log 2>&1; cat $OUT/b/window.log
