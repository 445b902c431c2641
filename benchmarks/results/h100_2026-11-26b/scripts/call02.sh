#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/head/hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_kernels.py tests/test_compile_default.py tests/test_kernel_sampling.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log; grep -E "FAIL|Error" $OUT/tests.log | head
timeout 60 python3 benchmarks/bench_sampling.py --quick --greedy-only --out $OUT/sampling > $OUT/argmax.log 2>&1; cat $OUT/argmax.log | grep "|" | tail -20
ds() { timeout 100 python3 $2 benchmarks/bench_decode_step.py --model llama-1b --variants compiled --batches 1,8,24,64,128,256 --out /tmp/ds_$1 2>&1 | grep -v Warn | grep "|" > $OUT/decode_step_$1.log; echo "== $1"; cat $OUT/decode_step_$1.log; }
ds new ""
ds nocombo "benchmarks/scratch/nocombo.py" 
cd benchmarks/scratch/head && PYTHONPATH=$PWD ds head "" && cd ../../..
e2e() { timeout 120 python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e_$1 --no-progress > $OUT/llama_$1.log 2>&1; echo "== e2e $1"; grep -A3 "bound:" $OUT/llama_$1.log | tail -1; grep "steady" $OUT/llama_$1.log; }
e2e new
cd benchmarks/scratch/head && PYTHONPATH=$PWD e2e head; cd ../../..
