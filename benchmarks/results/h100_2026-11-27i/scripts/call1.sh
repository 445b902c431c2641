#!/bin/bash
# call 1: decode kernel A/B (HEAD 78d6673 = old, working tree = new, newb = new + V load beside K), GPU kernel tests
export PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX=/tmp/pycache
SP=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 $SP hf_paged > /dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
S=benchmarks/scratch/s21
run() { # tag dir
  if [ "$2" = "." ]; then timeout 150 python3 $S/kab.py $OUT $1 > $OUT/kab_$1.log 2>&1; echo "$1 rc $?";
  else (cd $S/$2 && PYTHONPATH=$PWD timeout 150 python3 ../kab.py $OUT $1 > $OUT/kab_$1.log 2>&1; echo "$1 rc $?"); fi
  tail -1 $OUT/kab_$1.log
}
run old1 old
run new1 .
run newb1 newb
run old2 old
run new2 .
run newb2 newb
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fused_decode.py tests/test_kernels.py -x > $OUT/tests.log 2>&1; echo "tests rc $?"; tail -2 $OUT/tests.log
python3 - <<'PY'
import os, torch
out = os.environ["OUT"]
a = torch.load(f"{out}/kab_old1.pt"); 
for tag in ("new1", "newb1"):
    b = torch.load(f"{out}/kab_{tag}.pt")
    bad = [k for k in a if not (torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]))]
    print(tag, "bitwise equal to old on", len(a) - len(bad), "of", len(a), "shapes; differ:", bad[:5])
PY
