#!/bin/bash
# H100: after the int32 index vectors (no Triton variant of its own): GPU tests; Qwen3 sampled and llama-1b ShareGPT
# 1000 with ragged graphs on/off; steady arrivals at 120/s
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/d
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf --tb=short tests/test_ragged_graphs.py > $OUT/d/tests.log 2>&1
grep -E "passed|failed|^E |^FAILED" $OUT/d/tests.log | head -20
run() {
  local tag=$1 on=$2; shift 2
  RAGGED=$on timeout 120 python3 benchmarks/scratch/s11/with_ragged.py benchmarks/bench_generate.py "$@" --systems paged_compiled --out $OUT/d/$tag --no-progress 2>&1 | grep -v Warn > $OUT/d/$tag.log
  grep -A2 "bound / run" $OUT/d/$tag.log | tail -1 | sed "s/^/$tag /"
  python3 -c "import json,glob;r=json.load(open(glob.glob('$OUT/d/$tag/*.json')[0]))['rows'][0];t=r['timing'];print('$tag', {k:r.get(k) for k in ('steps','eager_steps','ragged_graph_steps','ragged_capture_s')}, 'prefill_s', round(t['prefill_total_s'],3), 'decode_host_ms', round(t['decode_host_ms'],3))"
  rm -f $OUT/d/$tag/*.png
}
Q="--model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95"
S="--model llama-1b --workload sharegpt --num-requests 1000"
run qw_on 1 $Q; run qw_off 0 $Q; run sg_on 1 $S; run sg_off 0 $S
timeout 120 python3 benchmarks/scratch/s11/arrivals.py 120 600 2>&1 | grep -v Warn > $OUT/d/arrivals120.log; tail -5 $OUT/d/arrivals120.log
