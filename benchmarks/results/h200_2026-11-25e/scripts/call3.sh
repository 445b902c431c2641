#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
export TRITON_CACHE_DIR=/tmp/jc/triton TORCHINDUCTOR_CACHE_DIR=/tmp/jc/inductor
python3 benchmarks/scratch/jit_log.py llama-1b > $OUT/jit_cold.log 2>&1
python3 benchmarks/scratch/jit_log.py llama-1b > $OUT/jit_warm.log 2>&1
unset TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR
grep -v inductor $OUT/jit_cold.log | tail -60
python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e --no-progress > $OUT/e2e_llama.log 2>&1
python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled --out /tmp/e2e --no-progress > $OUT/e2e_qwen.log 2>&1
tail -25 $OUT/e2e_llama.log; tail -25 $OUT/e2e_qwen.log
cp /tmp/e2e/*.json $OUT/ 2>/dev/null; ls /tmp/e2e
