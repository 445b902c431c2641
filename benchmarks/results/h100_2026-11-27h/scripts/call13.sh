#!/bin/bash
# call 13: bench_generate.py's GPU timeline with the picker hooked (the prefill steps' end events)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --no-progress --out $OUT/llama > $OUT/llama.log 2>&1; echo "rc $?"
grep -A2 "^| system | run s" $OUT/llama.log | tail -1; grep "GPU busy\|prefill steps of" $OUT/llama.log
python3 -c "import json;d=json.load(open('$OUT/llama/generate_llama-1b_sharegpt_256.json'));print(type(d['rows']).__name__, d['rows'][0]['gpu'])"
