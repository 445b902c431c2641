#!/bin/bash
# call 3 (H200): other shapes end to end (ShareGPT, compiled engine; gemma2-2b sampled), then the GPU tests again
# with the pool-sizing test's fix
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
t0=$(date +%s)
run() {  # tag args...
  local tag=$1; shift
  timeout 110 python3 benchmarks/bench_generate.py "$@" --systems paged_compiled --no-progress --out $OUT/$tag > $OUT/$tag.log 2>&1
  echo "$tag rc $? at $(( $(date +%s) - t0 )) s"; grep "^bound:" $OUT/$tag.log | cut -c1-60; grep -A2 "bound / run" $OUT/$tag.log | tail -1
  grep "a decode step's GPU time" $OUT/$tag.log | sed 's/.*a decode step/  decode step/'
}
run qwen25 --model qwen2.5-0.5b --workload sharegpt
run gemma2 --model gemma2-2b --workload sharegpt --temperature 0.8 --top-p 0.9
run phi3 --model phi3-mini --workload sharegpt
run llama8b --model llama-8b --workload sharegpt
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_memory_lifetime.py tests/test_pool_sizing.py > $OUT/tests.log 2>&1; echo "tests rc $? at $(( $(date +%s) - t0 )) s"; tail -3 $OUT/tests.log
rm -f $OUT/*.png $OUT/*/*.png $OUT/*/*.json
