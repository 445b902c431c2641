#!/bin/bash
# s17 call b: warm start-up with every site-package byte-compiled (as an installed environment has them), profile dumped
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged /usr/lib/python3.12 > /dev/null 2>&1
mkdir -p $OUT/b
export TORCHINDUCTOR_CACHE_DIR=/tmp/cc/inductor TRITON_CACHE_DIR=/tmp/cc/triton
python3 benchmarks/scratch/s17/warm_profile.py > $OUT/b/cold.log 2>&1
PROFILE=1 PROF_OUT=$OUT/b/warm.prof python3 benchmarks/scratch/s17/warm_profile.py > $OUT/b/warm_prof.log 2>&1
for i in 1 2; do python3 benchmarks/scratch/s17/warm_profile.py > $OUT/b/warm$i.log 2>&1; done
python3 -X importtime -c "import torch._inductor.compile_fx, torch._dynamo" 2> $OUT/b/importtime.txt
grep -h "engine_s\|frames" $OUT/b/*.log
