"""Registers, shared memory and cp.async count of a Triton kernel compiled offline for sm_90 (no GPU needed).

Usage: PTRS="dict(Q='*bf16', ...)" CONSTS="dict(G=4, ...)" FLOATS="['qk_scale']" NODIV="['stride_btb']" NS=2 NW=4
python register_count.py MODULE KERNEL. Pointers and the integer arguments not in NODIV get the divisibility-16
attribute a real launch gives them (without it the pipeliner emits no cp.async).
"""
import importlib
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/scratch/s8")
fn = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
ptr_types = eval(os.environ["PTRS"])
consts = eval(os.environ["CONSTS"])
floats = set(eval(os.environ.get("FLOATS", "[]")))
nodiv = set(eval(os.environ.get("NODIV", "[]")))
sig, const, attrs = {}, {}, {}
for i, p in enumerate(fn.arg_names):
    if p in ptr_types:
        sig[p] = ptr_types[p]
    elif p in consts:
        sig[p] = "constexpr"
        const[p] = consts[p]
    elif p in floats:
        sig[p] = "fp32"
    else:
        sig[p] = "i32"
    if sig[p].startswith("*") or (sig[p] == "i32" and p not in nodiv):
        attrs[(i,)] = [["tt.divisibility", 16]]
src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}, attrs=attrs)
opts = dict(num_warps=int(os.environ.get("NW", 4)), num_stages=int(os.environ.get("NS", 2)))
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
ptx = k.asm["ptx"]
open("/tmp/k.cubin", "wb").write(k.asm["cubin"])
bin_dir = os.path.dirname(triton.__file__) + "/backends/nvidia/bin/"
usage = subprocess.run([bin_dir + "cuobjdump", "--dump-resource-usage", "/tmp/k.cubin"], capture_output=True,
                       text=True).stdout
print(re.findall(r"REG:\d+|STACK:\d+|LOCAL:\d+", usage), "shared", k.metadata.shared,
      "cp.async", ptx.count("cp.async.ca") + ptx.count("cp.async.cg"), "ld.global", ptx.count("ld.global"))
