#!/bin/bash
# s17 call d: Qwen3 sampled with top-k 50 end to end, SORT_N 2048 against the library before the sorted selection
# (0efa548), alternating; the sampling tests on the GPU
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s17/old/hf_paged > /dev/null 2>&1
mkdir -p $OUT/d
run() {  # $1 = tag, $2 = dir, $3 = top-k
  (cd $2 && PYTHONPATH=$PWD timeout 150 python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95 --top-k $3 --systems paged_compiled --out /tmp/d_$1 --no-progress > $OUT/d/qwen3_$1.log 2>&1)
  cp /tmp/d_$1/*.json $OUT/d/qwen3_$1.json 2>/dev/null
  grep -A3 "bound / run" $OUT/d/qwen3_$1.log | grep "^| paged" | sed "s/^/$1 /"
}
run new_k50_1 . 50
run old_k50_1 benchmarks/scratch/s17/old 50
run new_k50_2 . 50
run old_k50_2 benchmarks/scratch/s17/old 50
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sampling.py tests/test_sampling_select.py > $OUT/d/tests.log 2>&1
tail -3 $OUT/d/tests.log
