#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernel_sampling.py tests/test_parallel_jit.py tests/test_kernels.py tests/test_sibling_linears.py > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log; grep -E "FAIL|Error" $OUT/tests.log | head -20
python3 benchmarks/bench_generate.py --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled --out /tmp/e2e --no-progress > $OUT/e2e_qwen.log 2>&1
tail -8 $OUT/e2e_qwen.log
python3 benchmarks/bench_generate.py --model llama-1b --workload sharegpt --systems paged_compiled --out /tmp/e2e --no-progress > $OUT/e2e_llama.log 2>&1
tail -8 $OUT/e2e_llama.log
