#!/bin/bash
# s15 call a: GPU kernel tests, prefill kernel A/B (old = d8ea477, new = working tree), decode bucket probe
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
ROOT=$PWD
mkdir -p $OUT/a
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $OUT/a/gpu.txt
S=$ROOT/benchmarks/scratch/s15  # these scripts, as run from there
cd $S/old && timeout 120 python3 $S/prefill_ab.py default > $OUT/a/old_prefill.log 2>&1; cd $ROOT
timeout 200 python3 $S/prefill_ab.py default 128,64,4,3 128,128,8,2 64,64,4,2 > $OUT/a/new_prefill.log 2>&1
cd $S/old && timeout 60 python3 $S/prefill_ab.py default > $OUT/a/old_prefill2.log 2>&1; cd $ROOT
paste -d'\n' $OUT/a/old_prefill.log $OUT/a/new_prefill.log $OUT/a/old_prefill2.log
PYTHONPATH=$ROOT timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_features.py tests/test_kernels.py -k "prefill or cuda" -x > $OUT/a/tests.log 2>&1; tail -3 $OUT/a/tests.log
timeout 110 python3 $S/bucket_probe.py > $OUT/a/bucket.log 2>&1; grep -v Warn $OUT/a/bucket.log | tail -45
