"""Tile sweep of the fused gated kernel on the MLP shapes where the first rule lost, against the unfused path."""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from hf_paged.kernels import triton_gated_mlp as tg  # noqa: E402

torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.cache_size_limit = 256
SHAPES = {"qwen2.5-7b": (3584, 18944), "llama8b": (4096, 14336), "qwen3-0.6b": (1024, 3072), "llama1b": (2048, 8192),
          "smollm-135m": (576, 1536), "mistral-nemo": (5120, 14336)}
MS = [8, 32, 64]
CFGS = [(32, 128, 4, 4), (32, 128, 4, 3), (32, 64, 4, 5), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
        (64, 64, 4, 5), (128, 64, 4, 4), (128, 128, 8, 3), (128, 64, 8, 4), (16, 128, 4, 4), (16, 256, 4, 4)]


def unfused(x, w):
    h = F.linear(x, w)
    i = h.shape[-1] // 2
    return F.silu(h[:, :i]) * h[:, i:]


unfused_c = torch.compile(unfused, dynamic=False)


def graph_us(fn, copies, reps=3, replays=15):
    for c in copies:
        fn(c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for c in copies:
                fn(c)
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / (reps * len(copies)))
    return sorted(ts)[len(ts) // 2]


res = {}
for name, (K, I) in SHAPES.items():
    wbytes = 2 * I * K * 2
    ncopy = max(2, int(160e6 // wbytes))
    ws = [torch.randn(2 * I, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(ncopy)]
    for M in MS:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        row = {"unfused": graph_us(lambda w: unfused_c(x, w), ws)}
        bm = max(16, 1 << (M - 1).bit_length())
        for c in CFGS:
            cfg = (bm, *c)
            try:
                row[str(c)] = round(graph_us(lambda w: tg.gated_mlp_up(x, w, "silu", cfg), ws), 2)
            except Exception as e:  # noqa: BLE001
                row[str(c)] = str(e)[:40]
        res[f"{name}-{M}"] = row
        good = sorted((v, k) for k, v in row.items() if isinstance(v, float) and k != "unfused")[:4]
        print(f"{name:12s} M {M:3d} unfused {row['unfused']:6.2f}  " + "  ".join(f"{k}:{v}" for v, k in good), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gated_sweep2.json"), "w"), indent=1)
