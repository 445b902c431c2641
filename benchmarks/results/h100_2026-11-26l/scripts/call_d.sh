#!/bin/bash
# H100: buckets recorded in place of their second step (new) against right after it (3c244af, old): a server's
# first seconds under steady arrivals, and offline ShareGPT-1000; GPU tests
export PYTHONUNBUFFERED=1
mkdir -p $OUT/d
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/s12/old > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
NEW=$PWD; OLD=$PWD/benchmarks/scratch/s12/old:$PWD
for lib in new old new old; do
  if [ $lib = new ]; then P=$NEW; else P=$OLD; fi
  PYTHONPATH=$P timeout 100 python3 benchmarks/scratch/s12/arrivals.py 120 600 on,on 2>&1 | grep -v Warn | grep "rate\|recorded" | sed "s/^/$lib /" | tee -a $OUT/d/arrivals.log
done
i=0
for lib in new old new old; do
  i=$((i+1)); if [ $lib = new ]; then P=$NEW; else P=$OLD; fi
  PYTHONPATH=$P timeout 100 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --num-requests 1000 --systems paged_compiled --out /tmp/sg_$i --no-progress > $OUT/d/sg_${i}_$lib.log 2>&1
  grep -A2 "bound / run" $OUT/d/sg_${i}_$lib.log | tail -1 | sed "s/^/$lib /"
done
export PYTHONPATH=$NEW
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_ragged_graphs.py > $OUT/d/tests.log 2>&1; echo tests rc $?
tail -3 $OUT/d/tests.log
