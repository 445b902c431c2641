"""Old vs new paged decode kernel: short ragged contexts in a wide table (graph-timed, one process)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..")); sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import decode_old as old
import torch
from bench_decode_splits import graph_time_us

from hf_paged.kernels import triton_decode as new

torch.manual_seed(0)
print("| B | Hq/Hkv | d | contexts | table tokens | splits | old µs | new µs | max abs diff |")
for B, hq, hkv, d in ((8, 32, 8, 64), (32, 32, 8, 64), (64, 32, 8, 64), (128, 32, 8, 64), (8, 16, 8, 128), (32, 16, 8, 128), (96, 16, 8, 128)):
    for lo_len, hi_len, width in ((100, 600, 4096), (500, 1500, 4096), (1000, 3000, 8192)):
        bs = 16
        nblk = width // bs
        lens = torch.randint(lo_len, hi_len, (B,), device="cuda", dtype=torch.int32)
        total = B * nblk
        kc = torch.randn(total, hkv, bs, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(total, device="cuda").view(B, nblk).to(torch.int32)
        q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
        splits = new.choose_num_splits(B, hkv, width, new._CONFIGS[d][0], q.device)
        a = old.paged_decode(q, kc, vc, bt, lens, d ** -0.5)
        b = new.paged_decode(q, kc, vc, bt, lens, d ** -0.5)
        t_old = graph_time_us(lambda: old.paged_decode(q, kc, vc, bt, lens, d ** -0.5))
        t_new = graph_time_us(lambda: new.paged_decode(q, kc, vc, bt, lens, d ** -0.5))
        print(f"| {B} | {hq}/{hkv} | {d} | {lo_len}-{hi_len} | {width} | {splits} | {t_old:.1f} | {t_new:.1f} | {(a.float()-b.float()).abs().max().item():.2e} |", flush=True)
