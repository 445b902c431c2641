#!/bin/bash
# H100: ragged graphs in threads (global against thread_local), the ragged-graph tests, every architecture on the GPU
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/a
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
(timeout 300 python3 benchmarks/probe_compiled.py --jobs 10 --out $OUT/a/gpu_architectures_fp32.json > $OUT/a/probe_fp32.log 2>&1; echo probe rc $? >> $OUT/a/probe_fp32.log) &
PROBE=$!
timeout 120 python3 benchmarks/scratch/s12/global_mode.py global > $OUT/a/thread_global.log 2>&1; echo global rc $?
timeout 120 python3 benchmarks/scratch/s12/global_mode.py global > $OUT/a/thread_global2.log 2>&1; echo global2 rc $?
timeout 250 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_ragged_graphs.py > $OUT/a/tests.log 2>&1; echo tests rc $?
tail -3 $OUT/a/tests.log; tail -3 $OUT/a/thread_global.log; tail -3 $OUT/a/thread_global2.log
wait $PROBE
tail -2 $OUT/a/probe_fp32.log; grep -E "^[0-9]+ architectures" $OUT/a/probe_fp32.log; grep -iE "\| (differs|error) " $OUT/a/probe_fp32.log | head -20
