#!/bin/bash
# H100: an engine recording while another serves (thread_local against global); bf16 probe of every architecture;
# GPU tests of the graph paths
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/b
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
(timeout 330 python3 benchmarks/probe_compiled.py --dtype bfloat16 --jobs 9 --out $OUT/b/gpu_architectures_bf16.json > $OUT/b/probe_bf16.log 2>&1; echo probe rc $? >> $OUT/b/probe_bf16.log) &
PROBE=$!
for mode in global thread_local global thread_local; do
  timeout 150 python3 benchmarks/scratch/s12/global_mode.py $mode > $OUT/b/thread_$mode.log 2>&1; echo $mode rc $?; tail -1 $OUT/b/thread_$mode.log
done
timeout 280 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_ragged_graphs.py tests/test_gpu.py tests/test_pipelined_decode.py > $OUT/b/tests.log 2>&1; echo tests rc $?
tail -3 $OUT/b/tests.log
wait $PROBE
tail -1 $OUT/b/probe_bf16.log; grep -E "^[0-9]+ architectures" $OUT/b/probe_bf16.log; grep -iE "\| (differs|error) " $OUT/b/probe_bf16.log | head -20
