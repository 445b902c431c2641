#!/bin/bash
# s17 call c: the sampler's sorted selection: kernel A/B (sort_n 0 vs default), Qwen3 sampled end to end with top-k 50
# (new vs old library, alternating) and with top-k 0, the sampling tests on the GPU
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s17/old/hf_paged > /dev/null 2>&1
mkdir -p $OUT/c
timeout 200 python3 benchmarks/scratch/s17/sampler_sort_ab.py > $OUT/c/kernel_ab.log 2>&1
cat $OUT/c/kernel_ab.log | grep "^|" | head -80
run() {  # $1 = tag, $2 = dir, $3 = top-k
  (cd $2 && PYTHONPATH=$PWD timeout 150 python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95 --top-k $3 --systems paged_compiled --out /tmp/c_$1 --no-progress > $OUT/c/qwen3_$1.log 2>&1)
  grep -A3 "bound / run" $OUT/c/qwen3_$1.log | grep "^| paged" | sed "s/^/$1 /"
}
run new_k50_1 . 50
run old_k50_1 benchmarks/scratch/s17/old 50
run new_k50_2 . 50
run old_k50_2 benchmarks/scratch/s17/old 50
run new_k0 . 0
run old_k0 benchmarks/scratch/s17/old 0
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_sampling.py > $OUT/c/tests.log 2>&1
tail -3 $OUT/c/tests.log
