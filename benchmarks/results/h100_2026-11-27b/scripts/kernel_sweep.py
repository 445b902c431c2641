"""Decode kernel variants (module attributes, launch options) at the ragged lengths of ShareGPT-like runs, across\nhead counts, head dims and a sliding window."""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_decode_splits import graph_time_us  # noqa: E402
from bench_generate import make_workload  # noqa: E402

from hf_paged.kernels import triton_decode as new  # noqa: E402

mods = {"new": new}
bs = 16


def snapshots(kind, n, ths):
    wl = make_workload(kind, n, 0)
    ins = np.array([len(p) for p, _ in wl]); outs = np.array([o for _, o in wl])
    res = {}
    for t in range(0, int(outs.max())):
        alive = outs > t; c = int(alive.sum())
        for th in ths:
            if th not in res and c <= th:
                res[th] = (ins[alive] + t).tolist()
    return res


shapes = []
snap = snapshots("sharegpt", 256, (200, 64, 24, 8))
for th, lens in snap.items():  # (name, Hq, Hkv, D, lens, width, window)
    shapes.append((f"llama1b-{th}", 32, 8, 64, lens, 4096, None))
    shapes.append((f"gemma3-full-{th}", 4, 1, 256, lens, 4096, None))
    shapes.append((f"gemma3-win512-{th}", 4, 1, 256, lens, 4096, 512))
    shapes.append((f"qwen25-{th}", 14, 2, 64, lens, 4096, None))
    shapes.append((f"gemma2-{th}", 8, 4, 256, lens, 4096, None))
    shapes.append((f"qwen3-{th}", 16, 8, 128, lens, 4096, None))
rng = np.random.default_rng(1)
shapes.append(("mha-d128-B64", 32, 32, 128, rng.integers(100, 2000, 64).tolist(), 4096, None))
shapes.append(("llama8b-B4-4000", 32, 8, 128, [4000, 3000, 500, 7000], 8192, None))
shapes.append(("mqa-d128-B4-4000", 32, 1, 128, [4000, 3000, 500, 7000], 8192, None))
only = os.environ.get("ONLY")
if only:
    shapes = [s for s in shapes if any(o in s[0] for o in only.split(","))]

VARIANTS = json.loads(os.environ.get("VARIANTS", '{"head": ["head", {}], "new": ["new", {}]}'))
results = {}
for name, Hq, Hkv, D, lens, width, window in shapes:
    n = len(lens)
    buckets = [1, 2, 4, 8] + list(range(16, 129, 16)) + list(range(160, 257, 32))
    B = next(b for b in buckets if b >= n)
    mb = width // bs
    need = sum((x + bs) // bs for x in lens)
    per_layer = need * Hkv * bs * D * 2 * 2
    L = max(2, min(16, int(12e9 // max(per_layer, 1))))
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
            bt[r, :k] = perm[at:at + k]; at += k
        layers.append((kc, vc, bt))
    seq = torch.zeros(B, dtype=torch.int32, device="cuda")
    seq[:n] = torch.tensor(lens, dtype=torch.int32) + 1
    bt0 = layers[0][2].cpu()
    slots = torch.full((B,), -1, dtype=torch.long, device="cuda")
    slots[:n] = torch.tensor([int(bt0[r, x // bs]) * bs + x % bs for r, x in enumerate(lens)], dtype=torch.long)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16); vn = torch.randn_like(kn)
    counters = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
    bound_us = sum(min(x + 1, window or x + 1) for x in lens) * Hkv * D * 2 * 2 / 3.0e12 * 1e6
    row = {"n": n, "bucket": B, "mean_len": float(np.mean(lens)), "max_len": int(max(lens)), "bound_us": bound_us,
           "splits": new.default_num_splits(B, Hkv, D, mb * bs, q.device)}
    outs = {}
    for vname, (mod_name, opts) in VARIANTS.items():
        mod = mods[mod_name]
        saved = {k: getattr(mod, k) for k in opts.get("attrs", {})}
        for k, v in opts.get("attrs", {}).items():
            setattr(mod, k, v)
        out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)
        opts = dict(opts)
        opts.pop("attrs", None)
        if window:
            opts["sliding_window"] = window
        sq = torch.zeros_like(seq) if opts.pop("seq_zero", False) else seq
        if opts.pop("no_write", False):
            nkv = None
        else:
            nkv = (kn, vn, slots)

        def call():
            for kc, vc, bt in layers:
                mod.paged_decode(q, kc, vc, bt, sq, 0.125, max_context=mb * bs, out=out, new_kv=nkv,
                                 split_counters=counters, **opts)
        try:
            row[vname] = round(graph_time_us(call, calls=1, replays=30) / L, 2)
            outs[vname] = out[:n].clone()
        except Exception as e:
            row[vname] = str(e)[:80]
        for k, v in saved.items():
            setattr(mod, k, v)
    ref = outs.get("new")
    row["equal_to_new"] = {k: bool(torch.equal(v, ref)) if ref is not None else None for k, v in outs.items()}
    results[name] = row
    cells = "  ".join(f"{k} {row[k]}" for k in VARIANTS)
    print(f"{name:22s} n {n:3d} mean {row['mean_len']:6.0f} bound {bound_us:6.1f}  {cells}  eq {row['equal_to_new']}",
          flush=True)
json.dump(results, open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("AB_NAME", "kernel_ab") + ".json"), "w"), indent=1)
