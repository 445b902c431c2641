#!/bin/bash
# H100: the new CUDA test (seeded sampling, beams, parallel samples); Qwen3 sampled decode host time, the tenth
# session's library (6bf9a1c, benchmarks/scratch/s11/old) against this one, alternating
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/f
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged > /dev/null 2>&1
pip install -q --no-index --find-links .wheels pytest > /dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:logging -rf --tb=short tests/test_ragged_graphs.py > $OUT/f/tests.log 2>&1
grep -E "passed|failed|^E |^FAILED" $OUT/f/tests.log | head -20
run() {
  local tag=$1 script=$2; shift 2
  timeout 120 python3 $script "$@" --systems paged_compiled --out $OUT/f/$tag --no-progress 2>&1 | grep -v Warn > $OUT/f/$tag.log
  python3 -c "import json,glob;r=json.load(open(glob.glob('$OUT/f/$tag/*.json')[0]))['rows'][0];t=r['timing'];print('$tag', 'run_s', round(r['run_s'],2), 'decode_host_ms', round(t['decode_host_ms'],3), {k:round(v['execute_ms'],3) for k,v in t['decode_by_batch'].items()})"
  rm -f $OUT/f/$tag/*.png
}
Q="--model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95"
run new1 benchmarks/bench_generate.py $Q; run old1 benchmarks/scratch/s11/old/benchmarks/bench_generate.py $Q
run new2 benchmarks/bench_generate.py $Q; run old2 benchmarks/scratch/s11/old/benchmarks/bench_generate.py $Q
