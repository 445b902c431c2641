"""Decode kernel: the run length of a split (MIN_TOKENS_PER_SPLIT) per KV-head count, at ragged lengths of real runs.

Each shape: the context lengths of a ShareGPT-like (or uniform) 256-request run when `rows` are left; K/V of L layers
in shuffled blocks; the step's own K/V written by the kernel, split counters (as the engine runs it). Times one
graph replay of the L layers (median of 30) per layer, us."""
import json
import sys

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_decode_splits import graph_time_us  # noqa: E402
from bench_generate import make_workload  # noqa: E402

from hf_paged.kernels import triton_decode as td  # noqa: E402

OUT = sys.argv[1]
bs = 16
RUNS = (64, 128, 256, 512)


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


HEADS = {"llama1b-32/8-d64": (32, 8, 64), "qwen05b-14/2-d64": (14, 2, 64), "qwen15b-12/2-d128": (12, 2, 128),
         "qwen7b-28/4-d128": (28, 4, 128), "gemma-8/1-d256": (8, 1, 256), "llama8b-tp2-16/4-d128": (16, 4, 128),
         "qwen3-16/8-d128": (16, 8, 128)}
share = snapshots("sharegpt", 256, (256, 128, 64, 24, 8))
uni = snapshots("uniform", 256, (256, 64, 8))
shapes = []
for hname, (Hq, Hkv, D) in HEADS.items():
    for th, lens in share.items():
        shapes.append((f"{hname}-sharegpt-{th}", Hq, Hkv, D, lens, 4096))
    if Hkv <= 4:
        for th, lens in uni.items():
            shapes.append((f"{hname}-uniform-{th}", Hq, Hkv, D, lens, 4096))

results = {}
for name, Hq, Hkv, D, lens, width in shapes:
    n = len(lens)
    buckets = [2, 4, 8] + list(range(16, 129, 16)) + list(range(160, 257, 32))
    B = next(b for b in buckets if b >= n)
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

    default = td.MIN_TOKENS_PER_SPLIT
    row = {"n": n, "bucket": B, "mean_len": float(np.mean(lens)), "max_len": int(max(lens)), "bound_us": bound_us,
           "layers": L}
    ref = None
    for run in RUNS:
        td.MIN_TOKENS_PER_SPLIT = run
        try:
            o = td.paged_decode(q, *layers[0], seq, 0.125, max_context=mb * bs, split_counters=counters).clone()
            ref = o if ref is None else ref
            row[f"diff{run}"] = (o[:n].float() - ref[:n].float()).abs().max().item()
            row[f"run{run}"] = round(graph_time_us(call, calls=1, replays=30) / L, 2)
            row[f"splits{run}"] = td.default_num_splits(B, Hkv, D, mb * bs, q.device)
        except Exception as error:
            row[f"run{run}"] = str(error)[:80]
        finally:
            td.MIN_TOKENS_PER_SPLIT = default
    results[name] = row
    times = {r: row[f"run{r}"] for r in RUNS if isinstance(row[f"run{r}"], float)}
    best = min(times, key=times.get)
    print(f"{name:36s} n {n:3d} mean {row['mean_len']:5.0f} bound {bound_us:6.1f} | "
          + " ".join(f"{r}:{times.get(r, float('nan')):7.2f}" for r in RUNS)
          + f" | best {best} ({times[default] / times[best] - 1:+.1%} vs 256)", flush=True)
    layers = None
    torch.cuda.empty_cache()
    json.dump(results, open(f"{OUT}/split_heads.json", "w"), indent=1)
