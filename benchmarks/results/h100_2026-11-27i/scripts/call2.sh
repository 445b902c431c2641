#!/bin/bash
# call 2: decode kernel A/B per change: old (78d6673), pro (the prologue's loads first), comb8 / comb4 (the combine
# unrolled 8 / 4 splits), all alternating twice; logs into one file each
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
S=benchmarks/scratch/s21
for r in 1 2; do for v in old pro comb8 comb4; do
  (cd $S/$v && PYTHONPATH=$PWD timeout 120 python3 ../kab.py /tmp $v$r >> $OUT/kab_all.log 2>&1; echo "$v$r rc $?")
  tail -1 $OUT/kab_all.log
done; done
