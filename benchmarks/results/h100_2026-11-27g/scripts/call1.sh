#!/bin/bash
# call 1: start-up A/B (HEAD 10de2b6 vs the import preload), then the split-run sweep per KV-head count
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s19/old/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
mkdir -p $OUT/startup
(cd benchmarks/scratch/s19/old && PYTHONPATH=$PWD timeout 200 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 4 --out $OUT/startup/old1 > $OUT/startup/old1.log 2>&1; echo "old1 rc $?")
tail -8 $OUT/startup/old1.log
PYTHONPATH=$ROOT timeout 200 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 4 --out $OUT/startup/new1 > $OUT/startup/new1.log 2>&1; echo "new1 rc $?"
tail -8 $OUT/startup/new1.log
PYTHONPATH=$ROOT timeout 200 python3 benchmarks/scratch/s19/split_heads.py $OUT > $OUT/split_heads.log 2>&1; echo "split rc $?"
cat $OUT/split_heads.log | grep -v Warning
