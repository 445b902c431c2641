#!/bin/bash
# H100: a bucket's first, second and third step, new (recorded in place of its second step) against old (3c244af)
export PYTHONUNBUFFERED=1
mkdir -p $OUT/e
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/s12/old > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
NEW=$PWD; OLD=$PWD/benchmarks/scratch/s12/old:$PWD
for lib in old new old new; do
  if [ $lib = new ]; then P=$NEW; else P=$OLD; fi
  PYTHONPATH=$P timeout 100 python3 benchmarks/scratch/s12/occurrences.py 2>&1 | grep -v Warn | grep "occurrence\|ragged steps" | sed "s/^/$lib /" | tee -a $OUT/e/occurrences.log
done
