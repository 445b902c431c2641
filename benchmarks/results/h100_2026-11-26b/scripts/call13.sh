#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .wheels pytest
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_fused_decode.py tests/test_argmax.py tests/test_decode_batch.py tests/test_pipelined_decode.py tests/test_kernels.py > $OUT/tests.log 2>&1; tail -2 $OUT/tests.log; grep -E "FAIL|Error" $OUT/tests.log | head
timeout 240 python3 benchmarks/probe_compiled.py --jobs 14 --dtype bfloat16 --out $OUT/gpu_architectures_bf16.json > $OUT/probe_bf16.log 2>&1; grep -E "^[0-9]+ architectures" $OUT/probe_bf16.log; grep -E "\| (differs|error) \|" $OUT/probe_bf16.log | head
