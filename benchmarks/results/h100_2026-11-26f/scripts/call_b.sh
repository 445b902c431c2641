#!/bin/bash
# start-up: cold, warm, warm again, then warm under cProfile (same caches)
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/b
C=/tmp/startup_cache; rm -rf $C
export TORCHINDUCTOR_CACHE_DIR=$C/inductor TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
for s in cold warm warm2; do
  /usr/bin/time -f "$s process wall %e s" python3 benchmarks/bench_startup.py --child llama-1b --compile-decode 2>&1 | grep -v Warn | tail -2 | cut -c1-600 | tee -a $OUT/b/startup.log
done
python3 -m cProfile -o /tmp/warm.prof benchmarks/bench_startup.py --child llama-1b --compile-decode > /dev/null 2>&1
python3 - <<'PY' | tee $OUT/b/profile.txt
import pstats
p = pstats.Stats("/tmp/warm.prof")
p.sort_stats("cumulative").print_stats(90)
p.sort_stats("tottime").print_stats(40)
PY
