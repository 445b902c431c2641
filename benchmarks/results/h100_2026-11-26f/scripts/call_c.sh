#!/bin/bash
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/c
env | grep -i "^PYTHON" | tee $OUT/c/env.txt
ls /opt/torch/.venv/lib/python3.12/site-packages/torch/__pycache__ 2>&1 | head -3 | tee -a $OUT/c/env.txt
C=/tmp/startup_cache; rm -rf $C
export TORCHINDUCTOR_CACHE_DIR=$C/inductor TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
for s in cold warm warm2; do
  /usr/bin/time -f "$s process wall %e s" python3 benchmarks/scratch/s6/warm_profile.py 2>&1 | grep -v Warn | grep -v warn | tail -3 | cut -c1-600 | tee -a $OUT/c/log.txt
done
PREIMPORT=1 python3 benchmarks/scratch/s6/warm_profile.py 2>&1 | grep -v Warn | grep -v warn | tail -2 | cut -c1-600 | tee -a $OUT/c/log.txt
PREIMPORT=1 PROFILE=1 python3 benchmarks/scratch/s6/warm_profile.py > $OUT/c/profile.txt 2>&1
grep preimport $OUT/c/profile.txt
