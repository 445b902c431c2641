"""Sampler kernel: the search alone (sort_n=0) against the sorted selection (the module default), CUDA-graph timed,
at Qwen3's vocabulary (151,936); tokens compared. Env SETS / KINDS / DTYPES narrow the table."""
import os
import sys

import torch

sys.path.insert(0, ".")
from hf_paged.kernels import triton_sampling as ts  # noqa: E402


def graph_us(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / reps


V = 151936
gen = torch.Generator(device="cuda").manual_seed(0)
SETS = {"t0.6-k50-p0.95": (0.6, 50, 0.95, 0.0), "t0.7-k50": (0.7, 50, 1.0, 0.0), "t1.0-k1000-p0.9": (1.0, 1000, 0.9, 0.0),
        "t0.7-p0.5": (0.7, 0, 0.5, 0.0), "t0.6-p0.95": (0.6, 0, 0.95, 0.0), "t1.0-k50-p0.9-m0.05": (1.0, 50, 0.9, 0.05),
        "t0.8-k5000": (0.8, 5000, 1.0, 0.0)}
only = os.environ.get("SETS")
NS = (0, 1024, 2048)
print("| rows | logits | params | search alone us | sort_n 1024 us | sort_n 2048 us | speed-up (1024) | same tokens |")
print("|---|---|---|---|---|---|---|---|")
for kind in os.environ.get("KINDS", "flat,peaked").split(","):
    for dtype in [getattr(torch, d) for d in os.environ.get("DTYPES", "bfloat16").split(",")]:
        for name, (t, k, p, mp) in SETS.items():
            if only and name not in only.split(","):
                continue
            for rows in (1, 8, 64, 128, 256):
                x = torch.randn(rows, V, device="cuda", generator=gen) * (1.0 if kind == "flat" else 3.0)
                if kind == "peaked":
                    x[:, :20] += 8.0
                x = x.to(dtype)
                inv_t = torch.full((rows,), 1.0 / t, device="cuda")
                top_k = torch.full((rows,), k, dtype=torch.int32, device="cuda")
                top_p = torch.full((rows,), p, device="cuda")
                lmp = torch.full((rows,), float(torch.log(torch.tensor(mp))) if mp else -float("inf"), device="cuda")
                seed = torch.arange(rows, device="cuda") * 7 + 1
                off = torch.arange(rows, device="cuda") + 100
                outs, times = {}, {}
                for n in NS:
                    def fn(n=n):
                        outs[n] = ts.sample_tokens(x, inv_t, top_k, top_p, lmp, seed, off, sort_n=n)
                    times[n] = graph_us(fn)
                    outs[n] = ts.sample_tokens(x, inv_t, top_k, top_p, lmp, seed, off, sort_n=n)
                same = all(torch.equal(outs[0], outs[n]) for n in NS)
                a, b, c = (times[n] for n in NS)
                print(f"| {rows} | {kind} {str(dtype)[6:]} | {name} | {a:.0f} | {b:.0f} | {c:.0f} | {a / b:.2f}x | "
                      f"{same} |", flush=True)
