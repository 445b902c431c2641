#!/bin/bash
# H100: an engine recording while another serves, with the recording lock: thread_local against global; GPU tests of
# the graph paths; phimoe's ragged recording failure falls back to eager steps with the eager engine's tokens
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/c
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
(timeout 200 python3 benchmarks/probe_compiled.py --dtype bfloat16 phimoe afmoe mixtral qwen3_moe > $OUT/c/probe_bf16_moe.log 2>&1; echo probe rc $? >> $OUT/c/probe_bf16_moe.log) &
PROBE=$!
for mode in thread_local global thread_local global thread_local; do
  timeout 150 python3 benchmarks/scratch/s12/global_mode.py $mode > $OUT/c/thread_$mode.log 2>&1; echo $mode rc $?; tail -1 $OUT/c/thread_$mode.log
done
timeout 330 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_ragged_graphs.py tests/test_gpu.py tests/test_compile_default.py tests/test_pipelined_decode.py > $OUT/c/tests.log 2>&1; echo tests rc $?
tail -3 $OUT/c/tests.log
wait $PROBE
grep "|\|architectures" $OUT/c/probe_bf16_moe.log | tail -8
