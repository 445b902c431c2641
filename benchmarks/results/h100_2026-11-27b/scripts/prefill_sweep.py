"""Paged prefill kernel launch configurations across head layouts and chunk shapes (TFLOP/s, CUDA-graph timed)."""
import sys

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_decode_splits import graph_time_us  # noqa: E402

from hf_paged.kernels import triton_prefill  # noqa: E402

bs = 16
rng = np.random.default_rng(0)
short = np.clip(rng.lognormal(np.log(161) - 0.5, 1.0, 400).astype(int), 4, 1024)
short = short[: np.searchsorted(np.cumsum(short), 16384)]
CHUNKS = {
    "long": [(5000, 5000), (7000, 7000), (4384, 4384)],
    "short": [(int(n), int(n)) for n in short],
    "cont": [(2048, 8192), (2048, 6144), (4096, 4096)],
}
HEADS = [(32, 8, 64), (14, 2, 64), (16, 8, 128), (32, 8, 128), (32, 32, 96), (8, 4, 256)]
CONFIGS = [None, (128, 64, 8, 2), (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (64, 64, 4, 2), (128, 32, 4, 3),
           (64, 32, 4, 2), (64, 32, 8, 2), (64, 32, 4, 3), (64, 64, 8, 2)]
only = sys.argv[1:]
for chunk_name, seqs in CHUNKS.items():
    for hq, hkv, d in HEADS:
        if only and f"{chunk_name}-{d}" not in only and chunk_name not in only:
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
        base = triton_prefill._config(hq // hkv, d, maxq, True)
        cells = []
        for cfg in CONFIGS:
            opts = {} if cfg is None else dict(block_m=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
            if cfg is not None and cfg[0] < hq // hkv:
                continue
            try:
                us = graph_time_us(lambda: triton_prefill.paged_prefill(q, kc, vc, bt, cu, sl, d**-0.5, maxq, **opts),
                                   calls=3, replays=10)
                cells.append((flops / us / 1e6, cfg or f"default{base}"))
            except Exception as e:  # noqa: BLE001
                cells.append((0.0, f"{cfg} failed {str(e)[:40]}"))
        best = max(cells, key=lambda c: c[0])
        print(f"{chunk_name:5s} Hq {hq:2d} Hkv {hkv:2d} d {d:3d} T {T} ({len(seqs)} seqs): "
              + "  ".join(f"{c[1]}={c[0]:.0f}" for c in cells) + f"   BEST {best[1]} {best[0]:.0f}", flush=True)
