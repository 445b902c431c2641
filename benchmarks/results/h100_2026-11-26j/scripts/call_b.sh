#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
python3 benchmarks/scratch/s10/graph_block.py 2>&1 | tee $OUT/graph_block.log
timeout 300 python3 benchmarks/scratch/s10/idle_probe.py llama-1b single,double,single,double,single,double 2>&1 | grep -v "Warn\|warn" | tee $OUT/idle_probe.log
