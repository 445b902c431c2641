#!/bin/bash
# H100, final library: the table; start-up; GPU tests of ragged graphs; every architecture (fp32) with ragged
# steps replayed
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/f
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline 2>/dev/null | head -1
run() {  # tag args
  local tag=$1; shift
  timeout 200 python3 benchmarks/bench_generate.py "$@" --out $OUT/f --no-progress 2>&1 | grep -v Warn > $OUT/f/$tag.log
  grep "^bound" $OUT/f/$tag.log | sed "s/^/$tag /"
  grep -A5 "bound / run" $OUT/f/$tag.log | grep "^| paged\|^| generate" | sed "s/^/$tag /"
}
run llama --model llama-1b --workload sharegpt --systems paged_compiled,paged,generate_batch_graphs --system-timeout 120
run qwen --model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95 --systems paged_compiled
run long --model llama-1b --workload long --num-requests 64 --systems paged_compiled
rm -f $OUT/f/*.png
timeout 120 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --out $OUT/f > $OUT/f/startup.log 2>&1; grep "|" $OUT/f/startup.log | tail -3
(timeout 240 python3 benchmarks/probe_compiled.py --jobs 10 --out $OUT/f/gpu_architectures_fp32.json > $OUT/f/probe_fp32.log 2>&1; echo probe rc $? >> $OUT/f/probe_fp32.log) &
PROBE=$!
timeout 230 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_ragged_graphs.py > $OUT/f/tests.log 2>&1; echo tests rc $?
tail -2 $OUT/f/tests.log
wait $PROBE
tail -1 $OUT/f/probe_fp32.log; grep -E "^[0-9]+ architectures" $OUT/f/probe_fp32.log; grep -iE "\| (differs|error) " $OUT/f/probe_fp32.log | head
