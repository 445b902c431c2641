#!/bin/bash
# H100: compiled start-up (cold / warm), this library against c72e18d (the eleventh session's), alternating
export PYTHONUNBUFFERED=1
mkdir -p $OUT/g
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/s12/old_k > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
for lib in new old new old; do
  if [ $lib = new ]; then P=$PWD; else P=$PWD/benchmarks/scratch/s12/old_k:$PWD; fi
  PYTHONPATH=$P timeout 100 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --out /tmp/st_$lib > /tmp/st.log 2>&1
  grep -E "^llama|warm_up phases|^\| llama" /tmp/st.log | head -6 | sed "s/^/$lib /" | tee -a $OUT/g/startup.log
done
