"""Probe: does prefetching the next weights into L2 (cp.async.bulk.prefetch.L2) during the decode step's
bandwidth-idle phases (attention, norms) shorten a llama-1b-shaped decode step?  Scratch, not shipped."""
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, ".")
from hf_paged.kernels import triton_decode as td

dev = "cuda"
torch.manual_seed(0)


@triton.jit
def _l2_prefetch(base, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    valid = offs < nbytes
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    addr = tl.where(valid, base + offs, base)
    size = tl.where(valid, size, 16)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                              [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, nbytes: int | None = None, chunk: int = 262144, offset: int = 0):
    total = t.numel() * t.element_size()
    nbytes = total - offset if nbytes is None else min(nbytes, total - offset)
    if nbytes <= 0:
        return
    nchunks = triton.cdiv(nbytes, chunk)
    _l2_prefetch[(triton.cdiv(nchunks, 32),)](t.data_ptr() + offset, nbytes, CHUNK=chunk, BLOCK=32, num_warps=1)


def timed(fn, reps=20):
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) * 1000)
    ts.sort()
    return ts[len(ts) // 2]


out = {}
# ---- 1. does the prefetch land in L2?
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
W = torch.randn(2048, 8192, dtype=torch.bfloat16, device=dev)  # down_proj, 33.5 MB
x1 = torch.randn(24, 8192, dtype=torch.bfloat16, device=dev)
res = {}
for mode in ["cold", "warm_read", "pf4k", "pf16k", "pf64k", "pf256k"]:
    vals = []
    for _ in range(15):
        flush.add_(1)
        if mode == "warm_read":
            W.sum()
        elif mode.startswith("pf"):
            prefetch(W, chunk={"pf4k": 4096, "pf16k": 16384, "pf64k": 65536, "pf256k": 262144}[mode])
        torch.cuda._sleep(100_000)  # ~50 us: give the prefetch time to land
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); F.linear(x1, W); e.record(); e.synchronize()
        vals.append(s.elapsed_time(e) * 1000)
    vals.sort()
    res[mode] = vals[len(vals) // 2]
# the prefetch kernel's own duration
res["pf16k_kernel_us"] = timed(lambda: prefetch(W, chunk=16384))
res["pf64k_kernel_us"] = timed(lambda: prefetch(W, chunk=65536))
print("prefetch check (down_proj GEMM at M=24, us):", json.dumps(res), flush=True)
out["check"] = res
del flush

# ---- 2. a llama-1b decode step in a CUDA graph
L, H, NQ, NKV, D, I, V = 16, 2048, 32, 8, 64, 8192, 128256
BS = 16
dt = torch.bfloat16
Wqkv = [torch.randn(3072, H, dtype=dt, device=dev) * 0.02 for _ in range(L)]
Wo = [torch.randn(H, H, dtype=dt, device=dev) * 0.02 for _ in range(L)]
Wgu = [torch.randn(2 * I, H, dtype=dt, device=dev) * 0.02 for _ in range(L)]
Wd = [torch.randn(H, I, dtype=dt, device=dev) * 0.02 for _ in range(L)]
ln = [torch.ones(H, dtype=dt, device=dev) for _ in range(2 * L + 1)]
Wlm = torch.randn(V, H, dtype=dt, device=dev) * 0.02


@torch.compile(dynamic=False)
def add_norm(x, r, w):
    r = x + r
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    return (h.to(x.dtype) * w), r


@torch.compile(dynamic=False)
def silu_mul(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


SHAPES = {24: (894, 1706), 64: (538, 1414), 128: (354, 1212), 256: (157, 1025)}


def lengths(n, mean, mx, g):
    # a skewed spread with the given mean and max (exponential, clipped)
    x = torch.empty(n).exponential_(1.0, generator=g) * mean
    x = x.clamp(8, mx).round().long()
    x[0] = mx
    return x


def build(B, evict):
    mean, mx = SHAPES[B]
    g = torch.Generator().manual_seed(B)
    lens = lengths(B, mean, mx, g)
    nblk = triton.cdiv(mx, BS)
    total_blocks = int(sum(triton.cdiv(int(l), BS) for l in lens)) + 8
    kc = [torch.randn(total_blocks, NKV, BS, D, dtype=dt, device=dev) for _ in range(L)]
    vc = [torch.randn(total_blocks, NKV, BS, D, dtype=dt, device=dev) for _ in range(L)]
    perm = torch.randperm(total_blocks, generator=g)
    bt = torch.zeros(B, nblk, dtype=torch.int32)
    p = 0
    for b, l in enumerate(lens.tolist()):
        n = triton.cdiv(l, BS)
        bt[b, :n] = perm[p:p + n]
        p += n
    bt = bt.to(dev)
    seq = lens.to(torch.int32).to(dev)
    slots = (bt.gather(1, ((seq.long() - 1) // BS).view(-1, 1)).view(-1).long() * BS + (seq.long() - 1) % BS).to(dev)
    cnt = torch.zeros(B * NKV, dtype=torch.int32, device=dev)
    kv_bytes = int(lens.sum()) * NKV * D * 2 * 2 * L
    return dict(kc=kc, vc=vc, bt=bt, seq=seq, slots=slots, cnt=cnt, mx=nblk * BS, kv_bytes=kv_bytes, evict=evict)


SIDE = torch.cuda.Stream()


def issue(items):
    if not items:
        return
    if SIDE_MODE:
        SIDE.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(SIDE):
            for _what, t, nb, off in items:
                prefetch(t, nb, offset=off)
    else:
        for _what, t, nb, off in items:
            prefetch(t, nb, offset=off)


def step(x, st, plan):
    r = torch.zeros_like(x)
    B = x.shape[0]
    for i in range(L):
        h, r = add_norm(x, r, ln[2 * i])
        qkv = F.linear(h, Wqkv[i])
        q = qkv[:, :2048].view(B, NQ, D)
        k = qkv[:, 2048:2560].view(B, NKV, D)
        v = qkv[:, 2560:].view(B, NKV, D)
        issue(plan.get(("pre_attn", i), []))
        a = td.paged_decode(q, st["kc"][i], st["vc"][i], st["bt"], st["seq"], 0.125, max_context=st["mx"],
                            new_kv=(k, v, st["slots"]), split_counters=st["cnt"])
        o = F.linear(a.view(B, H), Wo[i])
        h, r = add_norm(o, r, ln[2 * i + 1])
        gu = F.linear(h, Wgu[i])
        issue(plan.get(("pre_silu", i), []))
        m = silu_mul(gu)
        x = F.linear(m, Wd[i])
    h, r = add_norm(x, r, ln[-1])
    y = F.linear(h, Wlm)
    if plan:
        torch.cuda.current_stream().wait_stream(SIDE)
    return y


MB = 1 << 20


def plan_of(name):
    p = {}
    for i in range(L):
        nxt = Wqkv[i + 1] if i + 1 < L else None
        if name == "none":
            continue
        if name == "o":
            p[("pre_attn", i)] = [("o", Wo[i], None, 0)]
        if name == "o+gu8":
            p[("pre_attn", i)] = [("o", Wo[i], None, 0), ("gu", Wgu[i], 8 * MB, 0)]
        if name == "qkv_next":
            if nxt is not None:
                p[("pre_silu", i)] = [("qkv", nxt, None, 0)]
        if name in ("o+gu16", "o+gu16+qkv", "o+gu16+d16"):
            p[("pre_attn", i)] = [("o", Wo[i], None, 0), ("gu", Wgu[i], 16 * MB, 0)]
        if name == "o+gu32":
            p[("pre_attn", i)] = [("o", Wo[i], None, 0), ("gu", Wgu[i], 32 * MB, 0)]
        if name == "o+gu16+qkv" and nxt is not None:
            p[("pre_silu", i)] = [("qkv", nxt, None, 0)]
        if name == "o+gu16+d16":
            p[("pre_silu", i)] = [("d", Wd[i], 16 * MB, 0)]
    return p


PLANS = ["none", "o", "o+gu8", "o+gu16", "o+gu32", "qkv_next", "o+gu16+qkv", "o+gu16+d16"]
SIDE_MODE = True
copy_bw = 2.99e12
weight_bytes = sum(t.numel() * 2 for t in Wqkv + Wo + Wgu + Wd) + Wlm.numel() * 2
results = {}
for B in [24, 64, 128, 256]:
    for evict in [""]:
        td.KV_EVICTION = evict
        st = build(B, evict)
        x = torch.randn(B, H, dtype=dt, device=dev)
        bound = (weight_bytes + st["kv_bytes"]) / copy_bw * 1e6
        for name in PLANS:
            plan = plan_of(name)
            for _ in range(3):
                step(x, st, plan)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = step(x, st, plan)
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                s, e = torch.cuda.Event(True), torch.cuda.Event(True)
                s.record()
                for _ in range(40):
                    g.replay()
                e.record(); e.synchronize()
                ts.append(s.elapsed_time(e) * 1000 / 40)
            us = sorted(ts)[2]
            key = f"B{B}-{evict or 'normal'}-{name}"
            results[key] = dict(us=us, bound_us=bound)
            print(f"{key:40s} {us:8.1f} us  bound {bound:7.1f}  ({bound / us:.0%})", flush=True)
            del g
        del st
        torch.cuda.empty_cache()
out["steps"] = results
import os

json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "l2_probe.json"), "w"), indent=1)
