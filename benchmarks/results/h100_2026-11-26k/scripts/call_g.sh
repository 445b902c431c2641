#!/bin/bash
# H100: Qwen3 sampled decode host time: the tenth session's library (old), this one with ragged graphs off (RAGGED=0)
# and on, interleaved twice
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/g
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 16 $SP/torch $SP/transformers $SP/triton $SP/sympy hf_paged benchmarks/scratch/s11/old/hf_paged > /dev/null 2>&1
run() {
  local tag=$1; shift
  timeout 100 python3 "$@" --systems paged_compiled --out $OUT/g/$tag --no-progress 2>&1 | grep -v Warn > $OUT/g/$tag.log
  python3 -c "import json,glob;r=json.load(open(glob.glob('$OUT/g/$tag/*.json')[0]))['rows'][0];t=r['timing'];print('$tag', 'run_s', round(r['run_s'],2), 'decode_host_ms', round(t['decode_host_ms'],3), {k:round(v['execute_ms'],3) for k,v in t['decode_by_batch'].items()})"
  rm -f $OUT/g/$tag/*.png
}
Q="--model qwen3-0.6b --workload uniform --num-requests 256 --temperature 0.6 --top-p 0.95"
for i in 1 2; do
  run old$i benchmarks/scratch/s11/old/benchmarks/bench_generate.py $Q
  RAGGED=0 run off$i benchmarks/scratch/s11/with_ragged.py benchmarks/bench_generate.py $Q
  run on$i benchmarks/bench_generate.py $Q
done
