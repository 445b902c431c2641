#!/bin/bash
# call 8: where a warm start of the final tree goes (stack samples of the main thread; a cold process first)
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 80 python3 benchmarks/scratch/s19/warm_sample.py > $OUT/sample_cold.txt 2>&1; echo "cold rc $?"
for i in 1 2; do timeout 60 python3 benchmarks/scratch/s19/warm_sample.py > $OUT/sample_warm$i.txt 2>&1; echo "warm$i rc $?"; done
head -30 $OUT/sample_warm1.txt | grep -v Warn
