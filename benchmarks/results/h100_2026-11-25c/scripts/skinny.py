"""Skinny GEMM (decode: M <= 64) in Triton vs cuBLAS, CUDA-graph timed (device)."""
import json
import os

import torch
import triton
import triton.language as tl
import triton.testing


@triton.jit
def _mm_kernel(A, W, P, M, N, K, stride_am, stride_wn, k_per_split,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        a = tl.load(A + offs_m[:, None] * stride_am + offs_k[None, :], mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        tl.store(P + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        tl.store(P + offs_m[:, None] * N + offs_n[None, :], acc.to(P.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(P, O, MN, S: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(S):
        acc += tl.load(P + s * MN + offs, mask=mask, other=0.0)
    tl.store(O + offs, acc.to(O.dtype.element_ty), mask=mask)


def skinny_mm(a, w, block_n=64, block_k=128, split=None, num_warps=4, num_stages=4, sms=132):
    M, K = a.shape
    N = w.shape[0]
    bm = max(16, triton.next_power_of_2(M))
    tiles = triton.cdiv(N, block_n)
    if split is None:
        split = max(1, min(triton.cdiv(2 * sms, tiles), K // (block_k * 2)))
    kps = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    split = triton.cdiv(K, kps)
    out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    if split > 1:
        part = torch.empty(split, M, N, device=a.device, dtype=torch.float32)
        _mm_kernel[(tiles, split)](a, w, part, M, N, K, a.stride(0), w.stride(0), kps, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=True, num_warps=num_warps, num_stages=num_stages)
        _reduce_kernel[(triton.cdiv(M * N, 1024),)](part, out, M * N, S=split, BLOCK=1024)
    else:
        _mm_kernel[(tiles, 1)](a, w, out, M, N, K, a.stride(0), w.stride(0), kps, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=False, num_warps=num_warps, num_stages=num_stages)
    return out


SHAPES = {"llama q/o": (2048, 2048), "llama k/v": (512, 2048), "llama qkv": (3072, 2048), "llama gate/up": (8192, 2048),
          "llama gateup": (16384, 2048), "llama down": (2048, 8192),
          "qwen3 q": (2048, 1024), "qwen3 k/v": (1024, 1024), "qwen3 o": (1024, 2048), "qwen3 gate/up": (3072, 1024),
          "qwen3 down": (1024, 3072)}
CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns) for bn, bk, nw, ns in
           [(64, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 4), (128, 128, 4, 4), (64, 128, 4, 6), (32, 128, 2, 5), (128, 64, 4, 6), (64, 512, 8, 2)]]
bw = 3.0e12
res = []
print("| shape | M | MB | cuBLAS µs (% bw) | best triton µs (% bw) | best config | all configs µs |")
for name, (N, K) in SHAPES.items():
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    for M in (8, 16, 32, 64):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = a @ w.t()
        t_cublas = triton.testing.do_bench_cudagraph(lambda: torch.mm(a, w.t()), rep=50) * 1e3
        ts = []
        for c in CONFIGS:
            try:
                o = skinny_mm(a, w, **c)
            except Exception:
                ts.append(float("inf"))
                continue
            err = (o.float() - ref.float()).abs().max().item()
            assert err < 0.05, (name, M, c, err)
            ts.append(triton.testing.do_bench_cudagraph(lambda: skinny_mm(a, w, **c), rep=50) * 1e3)
        mb = (N * K * 2 + M * K * 2 + M * N * 2) / 1e6
        b = min(range(len(ts)), key=ts.__getitem__)
        print(f"| {name} | {M} | {mb:.1f} | {t_cublas:.1f} ({mb*1e6/bw/t_cublas*1e6:.0%}) | {ts[b]:.1f} ({mb*1e6/bw/ts[b]*1e6:.0%}) | {CONFIGS[b]} | {' '.join(f'{t:.1f}' for t in ts)} |", flush=True)
        res.append(dict(shape=name, M=M, cublas=t_cublas, triton=ts, configs=CONFIGS))
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "skinny.json"), "w"), indent=1)
