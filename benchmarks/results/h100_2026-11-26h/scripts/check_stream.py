"""Interpreter check of td_stream against hf_paged's torch reference (and the write of the step's K/V)."""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import td_stream  # noqa: E402

from hf_paged.kernels import reference  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32


def case(B, Hq, Hkv, D, lens, bs=16, pps=2, min_per=1, write=True, kvs=None, softcap=None, sinks=False, seed=0):
    torch.manual_seed(seed)
    need = sum((x + bs) // bs for x in lens) + 1
    kc = torch.randn(need, Hkv, bs, D, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    mb = max((x + bs) // bs for x in lens) + 1
    perm = torch.randperm(need - 1)
    bt = torch.zeros(B, mb, dtype=torch.int32)
    at = 0
    for r, x in enumerate(lens):
        k = (x + bs) // bs
        bt[r, :k] = perm[at:at + k]
        at += k
    bt = bt.to(dev)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, device=dev, dtype=dt)
    kn = torch.randn(B, Hkv, D, device=dev, dtype=dt)
    vn = torch.randn_like(kn)
    slots = torch.tensor([int(bt[r, (x - 1) // bs]) * bs + (x - 1) % bs if x > 0 else -1 for r, x in enumerate(lens)],
                         dtype=torch.long, device=dev)
    kv_start = torch.tensor(kvs, dtype=torch.int32, device=dev) if kvs is not None else None
    sk = torch.randn(Hq, device=dev) if sinks else None
    kc2, vc2 = kc.clone(), vc.clone()
    if write:
        reference.write_kv(kn, vn, kc2, vc2, slots)
    ref = reference.paged_decode(q, kc2, vc2, bt, seq, 0.125, kv_start, softcap=softcap, sinks=sk)
    table = td_stream.build_table(seq.cpu().numpy(), kvs, 64, dev)
    cnt = torch.zeros(B * Hkv, dtype=torch.int32, device=dev)
    out = td_stream.paged_decode(q, kc, vc, bt, seq, 0.125, kv_start, softcap=softcap, sinks=sk,
                                 new_kv=(kn, vn, slots) if write else None, split_counters=cnt, table=table,
                                 programs_per_sm=pps, min_per=min_per)
    err = (out.float() - ref.float()).abs().max().item()
    ok = err < (2e-2 if dt == torch.bfloat16 else 1e-4)
    ok &= bool((cnt == 0).all())
    if write:
        ok &= torch.equal(kc, kc2) and torch.equal(vc, vc2)
    print(f"B {B} lens {lens[:6]} pps {pps} min_per {min_per} write {write} err {err:.2e} "
          f"cnt0 {bool((cnt == 0).all())} {'OK' if ok else 'FAIL'}")
    return ok


rng = np.random.default_rng(0)
oks = []
oks.append(case(3, 8, 2, 32, [5, 130, 64], pps=1, min_per=1))
oks.append(case(3, 8, 2, 32, [5, 130, 64], pps=4, min_per=1))
oks.append(case(4, 4, 4, 16, [1, 200, 0, 65], pps=2, min_per=2))
oks.append(case(5, 8, 2, 32, rng.integers(1, 300, 5).tolist(), pps=3, min_per=1, write=False))
oks.append(case(4, 8, 2, 32, [70, 300, 129, 2], pps=2, min_per=1, kvs=[3, 100, 64, 0]))
oks.append(case(4, 8, 2, 32, [70, 300, 129, 2], pps=2, min_per=3, softcap=5.0, sinks=True))
oks.append(case(2, 4, 1, 16, [500, 10], pps=5, min_per=1))
print("ALL OK" if all(oks) else "SOME FAILED")
