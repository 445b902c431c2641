#!/bin/bash
# call 2 (d8844bf): llama-1b ShareGPT greedy at KV block sizes 16 (default) / 32 / 64; the sampled and
# long-prompt rows re-measured
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
bs() { # tag block-size
  timeout 80 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --block-size $2 --no-progress --out $OUT/$1 > $OUT/$1.log 2>&1; echo "$1 rc $? at $(( $(date +%s) - t0 )) s"
  grep -A2 "^| system | run s" $OUT/$1.log | tail -1; grep "GPU busy" $OUT/$1.log
}
bs bs16a 16
bs bs32a 32
bs bs64a 64
bs bs16b 16
bs bs32b 32
bs bs64b 64
timeout 110 python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled --no-progress --out $OUT/qwen3 > $OUT/qwen3.log 2>&1; echo "qwen3 rc $? at $(( $(date +%s) - t0 )) s"
grep -A2 "^| system | run s" $OUT/qwen3.log | tail -1; grep "GPU busy" $OUT/qwen3.log
timeout 90 python3 benchmarks/bench_generate.py --model llama-1b --workload long --num-requests 64 --systems paged_compiled --no-progress --out $OUT/long > $OUT/long.log 2>&1; echo "long rc $? at $(( $(date +%s) - t0 )) s"
grep -A2 "^| system | run s" $OUT/long.log | tail -1
rm -f $OUT/*/*.png
