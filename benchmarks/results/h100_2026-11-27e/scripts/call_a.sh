#!/bin/bash
# s17 call a: where a warm compiled start-up of llama-1b goes (cProfile of the main thread), and torch's precompile API
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
mkdir -p $OUT/a && cp $SP/torch/_dynamo/aot_compile.py $SP/torch/_dynamo/aot_compile_types.py $SP/torch/_dynamo/package.py $SP/torch/_dynamo/config.py $OUT/a/ 2>/dev/null
python3 -c "import torch,inspect; print(torch.__version__); print([n for n in dir(torch.compiler) if 'load' in n or 'save' in n or 'aot' in n]); import torch._dynamo.eval_frame as e; print([n for n in dir(e.OptimizedModule) if 'aot' in n])" > $OUT/a/api.txt 2>&1
export TORCHINDUCTOR_CACHE_DIR=/tmp/cc/inductor TRITON_CACHE_DIR=/tmp/cc/triton
python3 benchmarks/scratch/s17/warm_profile.py > $OUT/a/cold.log 2>&1
PROFILE=1 python3 benchmarks/scratch/s17/warm_profile.py > $OUT/a/warm_prof.log 2>&1
python3 benchmarks/scratch/s17/warm_profile.py > $OUT/a/warm.log 2>&1
tail -3 $OUT/a/cold.log $OUT/a/warm.log; grep engine_s $OUT/a/*.log
