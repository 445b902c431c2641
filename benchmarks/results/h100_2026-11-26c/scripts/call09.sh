#!/bin/bash
export PYTHONUNBUFFERED=1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
export PYTHONPATH=$PWD
timeout 230 python3 benchmarks/probe_compiled.py --dtype bfloat16 --jobs 14 --out $OUT/gpu_architectures_bf16.json > $OUT/probe_bf16.log 2>&1; echo rc $?; grep -E "^[0-9]+ architectures" $OUT/probe_bf16.log | tail -1; grep -iE "\| (differs|error) " $OUT/probe_bf16.log | head
