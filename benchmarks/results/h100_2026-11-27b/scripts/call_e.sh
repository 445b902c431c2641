#!/bin/bash
# more shapes through bench_generate (ShareGPT 256 greedy, compiled); start-up of gemma3-1b and gemma2-2b
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
MODELS="phi3-mini olmoe-1b-7b qwen2.5-0.5b" SYSTEMS=paged_compiled TMO=150 bash benchmarks/scratch/s14/call_a.sh
mkdir -p $OUT/e
timeout 200 python3 benchmarks/bench_startup.py --models gemma3-1b,gemma2-2b --modes compiled --out $OUT/e 2>&1 | grep -v Warn | tail -12
rm -f $OUT/e/*.png
