"""Sampler kernel: the search for every row (draw_first_rounds=0) against draw-first (the module default), CUDA-graph
timed, at Qwen3's vocabulary; tokens compared."""
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
print("| rows | logits | params | search us | draw-first us | speed-up | same tokens |")
print("|---|---|---|---|---|---|---|")
for kind in (__import__("os").environ.get("KINDS", "flat,peaked").split(",")):
    for dtype in (torch.bfloat16, torch.float32):
        sets = {"t0.6-p0.95": (0.6, 0, 0.95, 0.0), "t1.0-p0.9-m0.05": (1.0, 0, 0.9, 0.05),
                "t0.7-p0.8": (0.7, 0, 0.8, 0.0), "t0.7-p0.5": (0.7, 0, 0.5, 0.0), "t0.7-k50-p0.9": (0.7, 50, 0.9, 0.0)}
        only = __import__("os").environ.get("SETS")
        for name, (t, k, p, mp) in sets.items():
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
                outs = {}
                times = {}
                for n in (0, ts.DRAW_FIRST_ROUNDS):
                    def fn(n=n):
                        outs[n] = ts.sample_tokens(x, inv_t, top_k, top_p, lmp, seed, off, draw_first_rounds=n)
                    times[n] = graph_us(fn)
                    outs[n] = ts.sample_tokens(x, inv_t, top_k, top_p, lmp, seed, off, draw_first_rounds=n)
                same = bool(torch.equal(outs[0], outs[ts.DRAW_FIRST_ROUNDS]))
                a, b = times[0], times[ts.DRAW_FIRST_ROUNDS]
                print(f"| {rows} | {kind} {str(dtype)[6:]} | {name} | {a:.0f} | {b:.0f} | {a / b:.2f}x | {same} |",
                      flush=True)
