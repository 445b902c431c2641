"""Fused gate/up + activation (Triton) against cuBLAS gate_up + a compiled silu*mul, cold weights, CUDA graphs."""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from hf_paged.kernels import triton_gated_mlp as tg  # noqa: E402

torch.manual_seed(0)
SHAPES = {"llama1b": (2048, 8192), "qwen3-0.6b": (1024, 3072), "llama8b": (4096, 14336)}
MS = [int(m) for m in os.environ.get("MS", "2,8,16,32,64,128,256").split(",")]
SMALL = [(32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 4), (128, 64, 4, 4),
         (64, 64, 4, 5), (128, 128, 8, 3), (32, 128, 4, 6), (64, 64, 4, 4)]
LARGE = [(64, 64, 4, 4), (64, 128, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3), (32, 128, 4, 4),
         (128, 64, 8, 4), (64, 64, 8, 4)]


def silu_mul(h):
    i = h.shape[-1] // 2
    return F.silu(h[:, :i]) * h[:, i:]


silu_mul_c = torch.compile(silu_mul, dynamic=False)


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
        row = {"bytes_us": wbytes / 3.0e12 * 1e6}
        row["unfused"] = graph_us(lambda w: silu_mul_c(F.linear(x, w)), ws)
        row["gemm_only"] = graph_us(lambda w: F.linear(x, w), ws)
        ref = silu_mul_c(F.linear(x, ws[0])).float()
        bm = max(16, min(triton_next := 1 << (M - 1).bit_length(), 128))
        best = None
        cands = SMALL if bm <= 32 else LARGE
        row["table"] = list(tg.config_for(M))
        for cfg in [tuple(tg.config_for(M))] + [(bm, *c) for c in cands]:
            try:
                t = graph_us(lambda w: tg.gated_mlp_up(x, w, "silu", cfg), ws)
                err = (tg.gated_mlp_up(x, ws[0], "silu", cfg).float() - ref).abs().max().item()
            except Exception as e:  # noqa: BLE001
                row[str(cfg)] = str(e)[:60]
                continue
            row[str(cfg)] = [round(t, 2), err]
            if best is None or t < best[1]:
                best = (cfg, t)
        row["best"] = [list(best[0]), round(best[1], 2)] if best else None
        res[f"{name}-{M}"] = row
        print(f"{name:10s} M {M:4d} bytes {row['bytes_us']:6.1f} unfused {row['unfused']:7.2f} (gemm {row['gemm_only']:7.2f})"
              f"  table {row[str(tuple(tg.config_for(M)))]}  best {row['best']}", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "gated_sweep.json"), "w"), indent=1)
