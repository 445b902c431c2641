#!/bin/bash
# H100: GPU tests of ragged graphs; lone-request TTFT on/off; saturated runs on/off (alternating)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/a
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_ragged_graphs.py \
  "tests/test_gpu.py::test_cuda_graphs_equal_eager_under_pressure_with_forks_and_prefix_hits" \
  tests/test_pipelined_decode.py tests/test_admission.py 2>&1 | tail -15 > $OUT/a/tests.log
tail -3 $OUT/a/tests.log
timeout 100 python3 benchmarks/scratch/s11/ttft_ragged.py 2>&1 | grep -v Warn > $OUT/a/ttft.log; tail -3 $OUT/a/ttft.log
run() {
  local tag=$1 on=$2; shift 2
  RAGGED=$on timeout 100 python3 benchmarks/scratch/s11/with_ragged.py benchmarks/bench_generate.py "$@" --systems paged_compiled --out /tmp/e2e_$tag --no-progress 2>&1 | grep -v Warn > $OUT/a/$tag.log
  cp /tmp/e2e_$tag*.json $OUT/a/ 2>/dev/null
  grep -A2 "bound / run" $OUT/a/$tag.log | tail -1 | sed "s/^/$tag /"
}
A="--model llama-1b --workload alpaca --num-requests 1000"
S="--model llama-1b --workload sharegpt --num-requests 1000"
run al_on 1 $A; run al_off 0 $A; run sg_on 1 $S; run sg_off 0 $S
run al_on2 1 $A; run al_off2 0 $A
