"""Does cudaGraphLaunch block the host while the same graph exec is still running?  Scratch."""
import time

import torch

torch.manual_seed(0)
x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
ws = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(8)]


def body():
    y = x
    for i in range(96):
        y = torch.nn.functional.silu(y @ ws[i % 8])
    return y


s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    body()
torch.cuda.current_stream().wait_stream(s)
pool = torch.cuda.graph_pool_handle()
graphs = []
for _ in range(2):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        body()
    graphs.append(g)
torch.cuda.synchronize()
a, b = graphs
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record()
a.replay()
e1.record()
torch.cuda.synchronize()
print(f"one replay: {e0.elapsed_time(e1) * 1e3:.0f} us of GPU time")


def trial(first, second, n=20):
    host = []
    for _ in range(n):
        torch.cuda.synchronize()
        first.replay()
        t = time.perf_counter()
        second.replay()
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    host.sort()
    return f"median {host[n // 2] * 1e6:.0f} us, max {host[-1] * 1e6:.0f} us"


for _ in range(2):
    print("same graph twice: second launch host time", trial(a, a))
    print("two graphs:       second launch host time", trial(a, b))
# a chain: how far ahead can the host get?
for label, seq in (("a,a,a,a", [a, a, a, a]), ("a,b,a,b", [a, b, a, b])):
    torch.cuda.synchronize()
    t = time.perf_counter()
    marks = []
    for g in seq:
        g.replay()
        marks.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    print(label, "host return times us:", [round(m * 1e6) for m in marks], "done", round((time.perf_counter() - t) * 1e6))
