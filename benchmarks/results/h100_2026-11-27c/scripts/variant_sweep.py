"""Prefill kernel variants (files in variants/), default tiles, TFLOP/s CUDA-graph timed; with registers / spills."""
import importlib.util
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(1, os.path.join(os.getcwd(), "benchmarks"))
from bench_decode_splits import graph_time_us  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
names = sys.argv[1].split(",")
mods = {}
for n in names:
    spec = importlib.util.spec_from_file_location(n, os.path.join(HERE, "variants", n + ".py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    mods[n] = m
bs = 16
rng = np.random.default_rng(0)
short = np.clip(rng.lognormal(np.log(161) - 0.5, 1.0, 400).astype(int), 4, 1024)
short = short[: np.searchsorted(np.cumsum(short), 16384)]
mid = np.random.default_rng(1).integers(100, 1025, 64)
mid = mid[: np.searchsorted(np.cumsum(mid), 16384)]
CHUNKS = {"mid": [(int(n), int(n)) for n in mid], "long": [(5000, 5000), (7000, 7000), (4384, 4384)], "short": [(int(n), int(n)) for n in short],
          "cont": [(2048, 8192), (2048, 6144), (4096, 4096)]}
HEADS = [(32, 8, 64), (14, 2, 64), (16, 8, 128), (32, 8, 128), (32, 32, 96), (8, 4, 256)]
only = os.environ.get("ONLY")
window = int(os.environ.get("WINDOW", "0")) or None
for chunk_name, seqs in CHUNKS.items():
    for hq, hkv, d in HEADS:
        if only and chunk_name not in only.split(","):
            continue
        nblocks = sum((c + bs - 1) // bs for _, c in seqs) + 1
        kc = torch.randn(nblocks, hkv, bs, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        width = max((c + bs - 1) // bs for _, c in seqs)
        bt = torch.zeros(len(seqs), width, dtype=torch.int32, device="cuda")
        perm = torch.randperm(nblocks - 1, device="cuda").to(torch.int32)
        at = 0
        for i, (_, c) in enumerate(seqs):
            k = (c + bs - 1) // bs
            bt[i, :k] = perm[at:at + k]
            at += k
        T = sum(q for q, _ in seqs)
        q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0] + np.cumsum([s[0] for s in seqs]).tolist(), dtype=torch.int32, device="cuda")
        sl = torch.tensor([c for _, c in seqs], dtype=torch.int32, device="cuda")
        maxq = max(s[0] for s in seqs)
        flops = sum(4.0 * hq * d * (c - qn) * qn + 4.0 * hq * d * qn * (qn + 1) / 2 for qn, c in seqs)
        cells = []
        ref = None
        for n, m in mods.items():
            opts = dict(sliding_window=window) if window else {}
            us = graph_time_us(lambda: m.paged_prefill(q, kc, vc, bt, cu, sl, d**-0.5, maxq, **opts), calls=3,
                               replays=10)
            out = m.paged_prefill(q, kc, vc, bt, cu, sl, d**-0.5, maxq, **opts).float()
            err = 0.0 if ref is None else float((out - ref).abs().max())
            ref = out if ref is None else ref
            meta = ""
            try:
                for cache in m._paged_prefill_kernel.device_caches.values():
                    ks = list(cache[0].values())
                    k = ks[-1]
                    meta = f"r{k.n_regs}/s{k.n_spills}/sh{k.metadata.shared // 1024}k"
            except Exception as e:  # noqa: BLE001
                meta = str(e)[:30]
            cells.append(f"{n}={flops / us / 1e6:.0f}({meta},err{err:.3f})")
        print(f"{chunk_name:5s} Hq {hq:2d} Hkv {hkv:2d} d {d:3d}: " + "  ".join(cells), flush=True)
