#!/bin/bash
# s17 call f: start-up on one host, bench_startup's primed bytecode against the environment as-is (torch,
# transformers, triton, sympy byte-compiled beforehand, as earlier sessions measured); a single-thread CPU probe
export PYTHONUNBUFFERED=1
mkdir -p $OUT/f
python3 -c "
import time
t = time.perf_counter(); s = 0
for i in range(10**7): s += i * i
print(f'cpu probe: 10M-iteration Python loop {time.perf_counter() - t:.2f} s')" | tee $OUT/f/cpu.txt
nproc >> $OUT/f/cpu.txt; grep -m1 "model name" /proc/cpuinfo | tee -a $OUT/f/cpu.txt
timeout 200 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --out $OUT/f/primed > $OUT/f/primed.log 2>&1
grep -E "primed|engine total" $OUT/f/primed.log
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
PYTHONPYCACHEPREFIX=/tmp/pycache python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
PYTHONPYCACHEPREFIX=/tmp/pycache timeout 150 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --bytecode as-is --out $OUT/f/asis > $OUT/f/asis.log 2>&1
grep -E "engine total" $OUT/f/asis.log | sed "s/^/as-is /"
timeout 200 python3 benchmarks/bench_startup.py --models qwen3-0.6b --modes compiled --out $OUT/f/primed_qwen3 > $OUT/f/primed_qwen3.log 2>&1
grep -E "primed|engine total" $OUT/f/primed_qwen3.log
export PYTHONPYCACHEPREFIX=/tmp/pycache
timeout 120 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/f_llama --no-progress > $OUT/f/llama.log 2>&1
cp /tmp/f_llama/*.json $OUT/f/ 2>/dev/null
grep -A3 "bound / run" $OUT/f/llama.log | grep "^| paged"
