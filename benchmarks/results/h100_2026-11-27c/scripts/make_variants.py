"""The kernel variants of call b (run inline in the session; kept here as a script). Run from the repository root
with the library of each variant in place: pv0 from d8ea477's `triton_prefill.py` (in `old/`), pv1 from the first
version of the change (three loops, `tl.dot(p, v, acc)`); pnew (calls c, e) from 7e03228's module the same way."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
os.makedirs(os.path.join(HERE, "variants"), exist_ok=True)


def absolute(src: str) -> str:
    src = src.replace("from .triton_attention_end import", "from hf_paged.kernels.triton_attention_end import")
    return src.replace("from .triton_dims import", "from hf_paged.kernels.triton_dims import")


def write(name: str, src: str) -> None:
    with open(os.path.join(HERE, "variants", name + ".py"), "w") as f:
        f.write(src)


if sys.argv[1:] == ["pv0"]:
    write("pv0", absolute(open("benchmarks/scratch/s15/old/hf_paged/kernels/triton_prefill.py").read()))
elif sys.argv[1:] == ["pnew"]:
    write("pnew", absolute(open("hf_paged/kernels/triton_prefill.py").read()))
else:  # pv1 .. pv4_N from the first version of the change
    src = absolute(open("hf_paged/kernels/triton_prefill.py").read())
    write("pv1", src)
    v2 = src  # pv2: the products accumulated by an add, not in the dot
    for a, b in [('acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")',
                  'acc = acc + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")'),
                 ('acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")',
                  'acc = acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")'),
                 ('acc = tl.dot(p.to(v.dtype), v, acc)', 'acc = acc + tl.dot(p.to(v.dtype), v)')]:
        v2 = v2.replace(a, b)
    write("pv2", v2)
    thr_old = "        if HAS_CHUNK:\n            u_lo = hi\n            u_hi = hi\n"
    thr_new = thr_old + "        if u_hi - u_lo < {n} * BLOCK_N:\n            u_lo = hi\n            u_hi = hi\n"
    for name, base in (("pv3", src), ("pv4", v2)):  # pv3 / pv4: every tile masked below N whole ones
        for n in (2, 4, 8):
            write(f"{name}_{n}", base.replace(thr_old, thr_new.format(n=n)))
