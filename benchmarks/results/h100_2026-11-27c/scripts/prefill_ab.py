"""Paged prefill kernel, TFLOP/s (CUDA-graph timed), the library on sys.path[0]; argv: configs as bm,bn,w,s or 'default'."""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(1, os.path.join(os.getcwd(), "benchmarks"))
from bench_decode_splits import graph_time_us  # noqa: E402

from hf_paged.kernels import triton_prefill  # noqa: E402

bs = 16
rng = np.random.default_rng(0)
short = np.clip(rng.lognormal(np.log(161) - 0.5, 1.0, 400).astype(int), 4, 1024)
short = short[: np.searchsorted(np.cumsum(short), 16384)]
CHUNKS = {"long": [(5000, 5000), (7000, 7000), (4384, 4384)], "short": [(int(n), int(n)) for n in short],
          "cont": [(2048, 8192), (2048, 6144), (4096, 4096)]}
HEADS = [(32, 8, 64), (14, 2, 64), (16, 8, 128), (32, 8, 128), (32, 32, 96), (8, 4, 256)]
configs = [None if c == "default" else tuple(int(x) for x in c.split(",")) for c in (sys.argv[1:] or ["default"])]
extra = os.environ.get("EXTRA")  # sliding_window=N
for chunk_name, seqs in CHUNKS.items():
    for hq, hkv, d in HEADS:
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
        for cfg in configs:
            opts = {} if cfg is None else dict(block_m=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
            if extra:
                opts["sliding_window"] = int(extra.split("=")[1])
            if cfg is not None and cfg[0] < hq // hkv:
                continue
            try:
                us = graph_time_us(lambda: triton_prefill.paged_prefill(q, kc, vc, bt, cu, sl, d**-0.5, maxq, **opts),
                                   calls=3, replays=10)
                cells.append((flops / us / 1e6, cfg or "default"))
            except Exception as e:  # noqa: BLE001
                cells.append((0.0, f"{cfg} failed {str(e)[:60]}"))
        print(f"{chunk_name:5s} Hq {hq:2d} Hkv {hkv:2d} d {d:3d}: " + "  ".join(f"{c[1]}={c[0]:.0f}" for c in cells),
              flush=True)
