#!/bin/bash
# call 5: the committed prefetch rule: kernel A/B (rule vs never) in one process, GPU kernel tests, then qwen2.5-0.5b
# and llama-1b greedy ShareGPT end to end, 3c871fc (old2) against the working tree, alternating
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s19/old2/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
timeout 150 python3 benchmarks/scratch/s19/prefetch_rule_ab.py > $OUT/prefetch_rule_ab.log 2>&1; echo "ab rc $?"
grep -v Warn $OUT/prefetch_rule_ab.log
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_fused_decode.py -k "decode or ahead" > $OUT/tests.log 2>&1; echo "tests rc $?"
tail -2 $OUT/tests.log
run() {  # tree model tag
  if [ $1 = old ]; then D=$ROOT/benchmarks/scratch/s19/old2; else D=$ROOT; fi
  (cd $D && PYTHONPATH=$D timeout 100 python3 benchmarks/bench_generate.py --model $2 --workload sharegpt --systems paged_compiled --out $OUT/$3 --no-progress > $OUT/$3.log 2>&1; echo "$3 rc $?")
  grep -A2 "^| system | run s" $OUT/$3.log | tail -1
  rm -f $OUT/$3/*.png
}
run new qwen2.5-0.5b qwen_new1; run old qwen2.5-0.5b qwen_old1; run old qwen2.5-0.5b qwen_old2; run new qwen2.5-0.5b qwen_new2
run new llama-1b llama_new1; run old llama-1b llama_old1
