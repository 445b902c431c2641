"""Decode kernel: K/V loaded one tile ahead (PREFETCH_KV) against the default (block ids ahead by rule), one process, graph-timed,
at the lengths of real runs (as split_heads.py) and at a few tiny batches; outputs must be bitwise equal."""
import sys

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_decode_splits import graph_time_us  # noqa: E402
from bench_generate import make_workload  # noqa: E402

from hf_paged.kernels import triton_decode as td  # noqa: E402

bs = 16


def snapshots(kind, n, ths):
    wl = make_workload(kind, n, 0)
    ins = np.array([len(p) for p, _ in wl])
    outs = np.array([o for _, o in wl])
    res = {}
    for t in range(0, int(outs.max())):
        alive = outs > t
        c = int(alive.sum())
        for th in ths:
            if th not in res and c <= th:
                res[th] = (ins[alive] + t).tolist()
    return res


HEADS = {"llama1b 32/8 d64": (32, 8, 64), "qwen05b 14/2 d64": (14, 2, 64), "qwen3 16/8 d128": (16, 8, 128),
         "gemma 8/1 d256": (8, 1, 256), "llama8b 32/8 d128": (32, 8, 128)}
share = snapshots("sharegpt", 256, (256, 128, 64, 24, 8))
cases = []
for hname, heads in HEADS.items():
    for th, lens in share.items():
        cases.append((f"{hname} sharegpt-{th}", *heads, lens))
    for B, ctx in ((1, 1024), (1, 4000), (4, 2000)):
        cases.append((f"{hname} B{B} ctx{ctx}", *heads, [ctx] * B))
tot = {True: 0.0, False: 0.0}
for name, Hq, Hkv, D, lens in cases:
    n = len(lens)
    buckets = [2, 4, 8] + list(range(16, 129, 16)) + list(range(160, 257, 32))
    B = next(b for b in buckets if b >= n)
    width = 8192
    mb = width // bs
    need = sum((x + bs) // bs for x in lens)
    per_layer = need * Hkv * bs * D * 2 * 2
    L = max(2, min(16, int(8e9 // max(per_layer, 1))))
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(L):
        kc = torch.randn(need + 1, Hkv, bs, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        perm = torch.randperm(need, device="cuda", generator=g).to(torch.int32)
        bt = torch.zeros(B, mb, dtype=torch.int32, device="cuda")
        at = 0
        for r, x in enumerate(lens):
            k = (x + bs) // bs
            bt[r, :k] = perm[at:at + k]
            at += k
        layers.append((kc, vc, bt))
    seq = torch.zeros(B, dtype=torch.int32, device="cuda")
    seq[:n] = torch.tensor(lens, dtype=torch.int32) + 1
    bt0 = layers[0][2].cpu()
    slots = torch.full((B,), -1, dtype=torch.long, device="cuda")
    slots[:n] = torch.tensor([int(bt0[r, x // bs]) * bs + x % bs for r, x in enumerate(lens)], dtype=torch.long)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn_like(kn)
    out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
    bound_us = sum(x + 1 for x in lens) * Hkv * D * 2 * 2 / 3.0e12 * 1e6

    def call():
        for kc, vc, bt in layers:
            td.paged_decode(q, kc, vc, bt, seq, 0.125, max_context=mb * bs, out=out, new_kv=(kn, vn, slots),
                            split_counters=counters)

    res, outs = {}, {}
    for flag in (False, True, False, True):
        td.PREFETCH_KV = flag
        o = td.paged_decode(q, *layers[0], seq, 0.125, max_context=mb * bs, split_counters=counters).clone()
        outs[flag] = o
        res.setdefault(flag, []).append(graph_time_us(call, calls=1, replays=30) / L)
    td.PREFETCH_KV = False
    same = torch.equal(outs[True][:n], outs[False][:n])
    t_old, t_new = min(res[False]), min(res[True])
    tot[False] += t_old
    tot[True] += t_new
    print(f"{name:30s} n {n:3d} bound {bound_us:6.2f} | default {t_old:6.2f} kv-ahead {t_new:6.2f} "
          f"({t_old / t_new - 1:+.1%}) | {bound_us / t_old:.0%} -> {bound_us / t_new:.0%} | equal {same}", flush=True)
    layers = None
    torch.cuda.empty_cache()
print(f"sum over cases: default {tot[False]:.1f} us, kv-ahead {tot[True]:.1f} us ({tot[False] / tot[True] - 1:+.1%})")
