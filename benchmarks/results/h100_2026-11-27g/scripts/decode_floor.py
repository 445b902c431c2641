"""The decode kernel's fixed cost: 16 layers' launches in one CUDA graph, per layer, at tiny and small work, against
an empty Triton kernel's graph node; with and without the step's K/V write and the fused combine."""
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from bench_decode_splits import graph_time_us  # noqa: E402

from hf_paged.kernels import triton_decode as td  # noqa: E402


@triton.jit
def _empty(X):
    pid = tl.program_id(0)
    if pid < 0:
        tl.store(X, 0)


bs, L = 16, 16
x = torch.zeros(1, device="cuda")
print(f"empty triton kernel node: {graph_time_us(lambda: [_empty[(1,)](x) for _ in range(L)], calls=1, replays=30) / L:.2f} us")
print(f"empty triton kernel, 512 programs: "
      f"{graph_time_us(lambda: [_empty[(512,)](x) for _ in range(L)], calls=1, replays=30) / L:.2f} us")
for Hq, Hkv, D in ((32, 8, 64), (14, 2, 64), (32, 8, 128)):
    for B, ctx in ((1, 32), (1, 1024), (8, 256), (8, 1024), (24, 900), (64, 540)):
        mb = 4096 // bs
        need = B * (ctx // bs + 2)
        layers = []
        for _ in range(L):
            kc = torch.randn(need + 1, Hkv, bs, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            bt = torch.randperm(need, device="cuda").to(torch.int32)[: B * mb].reshape(B, -1) if B * mb <= need else \
                torch.randint(0, need, (B, mb), device="cuda", dtype=torch.int32)
            layers.append((kc, vc, bt))
        seq = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        slots = torch.arange(B, device="cuda", dtype=torch.long) * 3
        q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
        kn = torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)
        counters = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
        row = []
        for label, kw in (("engine", dict(new_kv=(kn, vn, slots), split_counters=counters)),
                          ("no-write", dict(split_counters=counters)),
                          ("no-fuse", dict(new_kv=(kn, vn, slots))),
                          ("1split", dict(new_kv=(kn, vn, slots), num_splits=1)),
                          ("w2", dict(new_kv=(kn, vn, slots), split_counters=counters, num_warps=2)),
                          ("s3", dict(new_kv=(kn, vn, slots), split_counters=counters, num_stages=3)),
                          ("n32", dict(new_kv=(kn, vn, slots), split_counters=counters, block_n=32))):
            def call(kw=kw):
                for kc, vc, bt in layers:
                    td.paged_decode(q, kc, vc, bt, seq, 0.125, max_context=mb * bs, out=out, **kw)
            try:
                row.append(f"{label} {graph_time_us(call, calls=1, replays=30) / L:6.2f}")
            except Exception as error:
                row.append(f"{label} err {str(error)[:40]}")
        bytes_us = B * ctx * Hkv * D * 2 * 2 / 3.0e12 * 1e6
        print(f"{Hq}/{Hkv} d{D} B{B:3d} ctx{ctx:5d} bytes {bytes_us:5.2f} us | splits "
              f"{td.default_num_splits(B, Hkv, D, mb * bs, q.device):2d} | " + " | ".join(row), flush=True)
        layers = None
        torch.cuda.empty_cache()
