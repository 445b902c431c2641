#!/bin/bash
# s18 call c: warm start-up A/B (old = cf2db03, new = working tree: key hash from construction, one warm-up forward
# before the decode recordings), alternating; then the GPU tests of the changed paths
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged benchmarks/scratch/s18/old/hf_paged > /dev/null 2>&1
mkdir -p $OUT/c
NEW=$PWD; OLD=$PWD/benchmarks/scratch/s18/old
for r in 1 2; do
  for t in old new; do
    D=$([ $t = old ] && echo $OLD || echo $NEW)
    (cd $D && PYTHONPATH=$D timeout 200 python3 benchmarks/bench_startup.py --models llama-1b --modes compiled --warm-runs 3 --out /tmp/c_${t}_$r > $OUT/c/${t}_$r.log 2>&1)
    echo "$t $r: $(grep -E "engine total|llama" $OUT/c/${t}_$r.log | tail -2 | tr '\n' ' ')"
  done
done
for t in old new; do for r in 1 2; do cp /tmp/c_${t}_$r/startup.json $OUT/c/${t}_$r.json; done; done
python3 - <<PY
import json
for t in ("old","new"):
    for r in (1,2):
        rows=json.load(open(f"$OUT/c/{t}_{r}.json"))
        print(t, r, [(x["state"], round(x["total_s"],2), round(x["construct_s"],2), {k: round(v,2) for k,v in x["warm_up_phases_s"].items() if isinstance(v,float) and v>0.05}) for x in rows])
PY
export TORCHINDUCTOR_CACHE_DIR=/tmp/cc/inductor TRITON_CACHE_DIR=/tmp/cc/triton
python3 benchmarks/scratch/s18/warm_sample.py > $OUT/c/sample_cold.txt 2>&1
python3 benchmarks/scratch/s18/warm_sample.py > $OUT/c/sample_warm.txt 2>&1
grep -v "Warn\|warn" $OUT/c/sample_warm.txt | head -14
(timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "graph or recording or captured"; timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_parallel_jit.py tests/test_pipelined_decode.py) > $OUT/c/tests.log 2>&1; grep -E "passed|failed|error" $OUT/c/tests.log
cd $OUT && tar czf c.tgz c && rm -rf c
