"""cuBLAS bf16 GEMM time vs M (the decode buckets), weights rotated through 4 copies so L2 does not hold them."""
import torch


def graph_us(fns, calls=40, replays=5):
    for f in fns: f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls): fns[i % len(fns)]()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays): g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / (calls * replays) * 1e3
shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192), "lm_head": (128256, 2048)}
Ms = [1, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 200, 224, 240, 256]
print("| M | " + " | ".join(f"{n} us" for n in shapes) + " | layer sum us | per-row layer us |")
for M in Ms:
    row = []
    for name, (N, K) in shapes.items():
        copies = 1 if name == "lm_head" else 4
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        row.append(graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws]))
        del ws
    layer = sum(row[:4])
    print(f"| {M} | " + " | ".join(f"{t:.1f}" for t in row) + f" | {layer:.1f} | {layer / M:.2f} |", flush=True)
