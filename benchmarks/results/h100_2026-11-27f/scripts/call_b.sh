#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
mkdir -p $OUT/b
export TORCHINDUCTOR_CACHE_DIR=/tmp/cb/inductor TRITON_CACHE_DIR=/tmp/cb/triton
python3 benchmarks/scratch/s18/warm_sample.py > $OUT/b/cold.txt 2>&1; head -12 $OUT/b/cold.txt | grep -v Warn
for i in 1 2; do python3 benchmarks/scratch/s18/warm_sample.py > $OUT/b/warm$i.txt 2>&1; done
grep -v "Warn\|warn" $OUT/b/warm1.txt | head -24
grep -A45 innermost $OUT/b/warm2.txt | head -40
