#!/bin/bash
# the rest of the suite on the GPU host, verbose (names of failures even if a shard is cut off)
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/g
python3 -m compileall -q /opt/torch/.venv/lib/python3.12/site-packages/torch /opt/torch/.venv/lib/python3.12/site-packages/transformers > /dev/null 2>&1
files=$(ls tests/test_*.py)
i=0
for f in $files; do echo $f >> /tmp/shard$((i % 4)); i=$((i+1)); done
grep -v test_beam.py /tmp/shard2 > /tmp/shard2b
for s in 1 2b 3; do
  (timeout 540 python3 -m pytest -v -p no:cacheprovider -p no:logging $(cat /tmp/shard$s) --tb=short 2>&1 | grep -v "DEBUG" > $OUT/g/shard$s.log) &
done
wait
for s in 1 2b 3; do echo "== $s $(grep -c PASSED $OUT/g/shard$s.log) passed"; grep -E "(FAILED|ERROR)" $OUT/g/shard$s.log | grep "::" | head -20; tail -1 $OUT/g/shard$s.log; done
