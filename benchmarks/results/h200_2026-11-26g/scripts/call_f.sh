#!/bin/bash
# the whole test suite on the GPU host (torch 2.11), in four shards run side by side
python3 -m pip install -q --no-index --find-links .wheels pytest 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD
mkdir -p $OUT/f
python3 -m compileall -q /opt/torch/.venv/lib/python3.12/site-packages/torch /opt/torch/.venv/lib/python3.12/site-packages/transformers > /dev/null 2>&1 &
wait
files=$(ls tests/test_*.py)
i=0
for f in $files; do echo $f >> /tmp/shard$((i % 4)); i=$((i+1)); done
for s in 0 1 2 3; do
  (timeout 530 python3 -m pytest -q -p no:cacheprovider -p no:logging $(cat /tmp/shard$s) --tb=short 2>&1 | grep -v "DEBUG" > $OUT/f/shard$s.log) &
done
wait
for s in 0 1 2 3; do grep -E "^(FAILED|ERROR)|passed|failed" $OUT/f/shard$s.log | tail -15; done
