#!/bin/bash
# call 3: every accepted architecture on the GPU at HEAD (78d6673), float32: no graphs / graphs / compiled, same tokens
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
timeout 480 python3 benchmarks/probe_compiled.py --jobs 14 --out $OUT/gpu_architectures_fp32.json > $OUT/probe_fp32.log 2>&1; echo "probe rc $? in $(( $(date +%s) - start )) s"
tail -3 $OUT/probe_fp32.log
grep -E "\| (differs|error) \|" $OUT/probe_fp32.log | head
