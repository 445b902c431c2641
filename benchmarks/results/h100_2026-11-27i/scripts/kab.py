"""Decode kernel A/B: the kernel as the engine runs it (step's K/V written by the kernel, split counters), default
heuristics, graph-timed per layer (median of 30 replays), at the context lengths of ShareGPT-like / uniform runs when
`rows` are left, plus few-row batches. Run from a tree's root (PYTHONPATH picks the tree). Saves outputs for a bitwise
comparison between trees."""
import json
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_decode_splits import graph_time_us  # noqa: E402
from bench_generate import make_workload  # noqa: E402

from hf_paged.kernels import triton_decode as td  # noqa: E402

OUT, TAG = sys.argv[1], sys.argv[2]
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


HEADS = {"llama1b-32/8-d64": (32, 8, 64), "qwen05b-14/2-d64": (14, 2, 64), "qwen7b-28/4-d128": (28, 4, 128),
         "gemma-8/1-d256": (8, 1, 256), "qwen3-16/8-d128": (16, 8, 128)}
share = snapshots("sharegpt", 256, (256, 64, 24, 8, 2))
uni = snapshots("uniform", 256, (256, 64, 8))
shapes = []
for hname, (Hq, Hkv, D) in HEADS.items():
    for th, lens in share.items():
        shapes.append((f"{hname}-sharegpt-{th}", Hq, Hkv, D, lens))
    for th, lens in uni.items():
        shapes.append((f"{hname}-uniform-{th}", Hq, Hkv, D, lens))
    shapes.append((f"{hname}-one-1000", Hq, Hkv, D, [1000]))
    shapes.append((f"{hname}-four-3000", Hq, Hkv, D, [3000, 2000, 1500, 800]))

results = {}
outs = {}
t_all = time.time()
for name, Hq, Hkv, D, lens in shapes:
    width = 4096
    n = len(lens)
    buckets = [1, 2, 4, 8] + list(range(16, 129, 16)) + list(range(160, 257, 32))
    B = next(b for b in buckets if b >= n)
    mb = width // bs
    need = sum((x + bs) // bs for x in lens)
    per_layer = need * Hkv * bs * D * 2 * 2
    L = max(2, min(16, int(8e9 // max(per_layer, 1))))
    g = torch.Generator(device="cuda").manual_seed(0)
    torch.manual_seed(0)
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

    # outputs: the engine's launch (counters) and the separate-combine launch, on fresh caches of layer 0
    kc0, vc0, bt = layers[0]
    o1 = td.paged_decode(q, kc0.clone(), vc0.clone(), bt, seq, 0.125, max_context=mb * bs, new_kv=(kn, vn, slots),
                         split_counters=counters)[:n].clone()
    o2 = td.paged_decode(q, kc0.clone(), vc0.clone(), bt, seq, 0.125, max_context=mb * bs,
                         new_kv=(kn, vn, slots))[:n].clone()
    outs[name] = (o1.cpu(), o2.cpu())
    us = graph_time_us(call, calls=1, replays=30) / L
    us2 = graph_time_us(call, calls=1, replays=30) / L
    t = min(us, us2)
    results[name] = {"n": n, "bucket": B, "bound_us": bound_us, "us": t, "layers": L,
                     "splits": td.default_num_splits(B, Hkv, D, mb * bs, q.device), "fused_eq_reduce": bool(torch.equal(o1, o2))}
    print(f"{TAG} {name:34s} n {n:3d} bound {bound_us:6.1f} us {t:7.2f} ({bound_us / t:4.0%}) splits "
          f"{results[name]['splits']} eq {results[name]['fused_eq_reduce']}", flush=True)
    layers = None
    torch.cuda.empty_cache()
json.dump(results, open(f"{OUT}/kab_{TAG}.json", "w"), indent=1)
torch.save(outs, f"{OUT}/kab_{TAG}.pt")
print(f"{TAG} total {time.time() - t_all:.0f} s; sum us {sum(r['us'] for r in results.values()):.1f}")
