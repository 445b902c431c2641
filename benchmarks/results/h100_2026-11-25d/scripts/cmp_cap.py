"""Sampler: the committed kernel at three scratch-list sizes (CAP), one process (device).

`sampling_cur` is the kernel before the change: `git show 01afc30:hf_paged/kernels/triton_sampling.py >
sampling_cur.py` beside this script. sampler/cmp_cap_merged_draw.log came from this script with the timed columns
calling the working tree's `triton_sampling.sample_tokens`, which then drew while compacting (reverted, never
committed).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import sampling_cur as cur  # noqa: E402
import torch  # noqa: E402
import triton.testing  # noqa: E402

V = 151936
PARAMS = {"t0.6-p0.95": (0.6, 0, 0.95, 0.0), "t0.8-k50": (0.8, 50, 1.0, 0.0),
          "t0.7-k50-p0.9-m0.05": (0.7, 50, 0.9, 0.05), "t1.0-p0.9": (1.0, 0, 0.9, 0.0)}
CAPS = (4096, 16384, 32768)


def dist(name, rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, V, device="cuda", generator=g)
    if name == "flat":
        return (x * 0.64).to(torch.bfloat16)
    x = x * 2.5
    top = torch.randint(0, V, (rows, 8), device="cuda", generator=g)
    x.scatter_(1, top, 14 + 4 * torch.rand(rows, 8, device="cuda", generator=g))
    return x.to(torch.bfloat16)


def args(rows, vals):
    t, k, p, m = vals
    def col(v, d):
        return torch.full((rows,), v, dtype=d, device="cuda")
    lmp = float(torch.log(torch.tensor(m))) if m > 0 else -float("inf")
    seed = torch.arange(rows, device="cuda") * 1000 + 7
    return (col(1.0 / t, torch.float32), col(k, torch.int32), col(p, torch.float32), col(lmp, torch.float32), seed,
            torch.full((rows,), 100, dtype=torch.long, device="cuda"))


print("| dist | params | rows | committed us | " + " | ".join(f"new cap {c} us" for c in CAPS) + " | mismatches |")
print("|---" * (5 + len(CAPS)) + "|")
for d in ("flat", "peaked"):
    for rows in (1, 64, 128, 256):
        logits = dist(d, rows)
        for name, vals in PARAMS.items():
            a = args(rows, vals)
            t_cur = triton.testing.do_bench(lambda: cur.sample_tokens(logits, *a), warmup=5, rep=40)
            ref = cur.sample_tokens(logits, *a)
            ts, mism = [], []
            for cap in CAPS:
                ts.append(triton.testing.do_bench(lambda: cur.sample_tokens(logits, *a, cap=cap), warmup=5, rep=40))
                mism.append(int((cur.sample_tokens(logits, *a, cap=cap) != ref).sum()))
            print(f"| {d} | {name} | {rows} | {t_cur * 1e3:.0f} | " + " | ".join(f"{t * 1e3:.0f}" for t in ts)
                  + f" | {mism} |", flush=True)
