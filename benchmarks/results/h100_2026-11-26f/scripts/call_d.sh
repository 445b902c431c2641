#!/bin/bash
# primed bytecode (as an installed package has), start-up cold/warm of the new tree, GPU tests
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
mkdir -p $OUT/d
python3 benchmarks/bench_startup.py --models llama-1b,qwen3-0.6b --modes compiled --out $OUT/d 2>&1 | grep -v Warn | grep -v "^ \{4\}[a-zA-Z_.]* *[0-9.]*$" | tail -16 | tee $OUT/d/startup.log
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_decode_batch.py tests/test_pipelined_decode.py tests/test_compile_default.py 2>&1 | tail -4 | tee $OUT/d/tests.log
