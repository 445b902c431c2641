"""One launch of the decode kernel per shape (for ncu): llama-1b ShareGPT lengths at 256 and 24 rows."""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_generate import make_workload  # noqa: E402

from hf_paged.kernels import triton_decode as td  # noqa: E402

bs = 16


def snapshot(kind, n, th):
    wl = make_workload(kind, n, 0)
    ins = np.array([len(p) for p, _ in wl]); outs = np.array([o for _, o in wl])
    for t in range(0, int(outs.max())):
        alive = outs > t
        if int(alive.sum()) <= th:
            return (ins[alive] + t).tolist()


for th in [int(x) for x in os.environ.get("ROWS", "256,24").split(",")]:
    lens = snapshot("sharegpt", 256, th)
    Hq, Hkv, D, width = 32, 8, 64, 4096
    n = len(lens)
    B = next(b for b in [1, 2, 4, 8] + list(range(16, 129, 16)) + list(range(160, 257, 32)) if b >= n)
    mb = width // bs
    need = sum((x + bs) // bs for x in lens)
    kc = torch.randn(need + 1, Hkv, bs, D, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    perm = torch.randperm(need, device="cuda").to(torch.int32)
    bt = torch.zeros(B, mb, dtype=torch.int32, device="cuda")
    at = 0
    for r, x in enumerate(lens):
        k = (x + bs) // bs; bt[r, :k] = perm[at:at + k]; at += k
    seq = torch.zeros(B, dtype=torch.int32, device="cuda"); seq[:n] = torch.tensor(lens, dtype=torch.int32) + 1
    slots = torch.full((B,), -1, dtype=torch.long, device="cuda")
    bt0 = bt.cpu()
    slots[:n] = torch.tensor([int(bt0[r, x // bs]) * bs + x % bs for r, x in enumerate(lens)], dtype=torch.long)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16); vn = torch.randn_like(kn)
    out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
    for _ in range(3):
        td.paged_decode(q, kc, vc, bt, seq, 0.125, max_context=mb * bs, out=out, new_kv=(kn, vn, slots),
                        split_counters=counters)
    torch.cuda.synchronize()
    print(th, "rows", n, "splits", td.default_num_splits(B, Hkv, D, mb * bs, q.device), flush=True)
