#!/bin/bash
# call 3: decode kernel with K/V loaded a tile ahead, A/B graph-timed, then end to end
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 220 python3 benchmarks/scratch/s20/kv_ab.py > $OUT/kv_ab.log 2>&1; echo "ab rc $?"
cat $OUT/kv_ab.log | grep -v -i warn
for f in 1 0; do
timeout 100 python3 benchmarks/scratch/s20/e2e_flag.py $f --model llama-1b --workload sharegpt --systems paged_compiled --no-progress --out $OUT/llama_$f > $OUT/llama_$f.log 2>&1; echo "llama $f rc $?"
grep -A2 "^| system | run s" $OUT/llama_$f.log
done
