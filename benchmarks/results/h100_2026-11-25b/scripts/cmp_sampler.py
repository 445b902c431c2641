"""Old vs new sampler kernel, one process (device)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import sampling_old as old
import sampling_two_sites as two
import torch
import triton
import triton.testing

from hf_paged.kernels import reference_sampling as ref
from hf_paged.kernels import triton_sampling as new

V = 151936
PARAMS = {"t0.6-p0.95": (0.6, 0, 0.95, 0.0), "t0.8-k50": (0.8, 50, 1.0, 0.0), "t0.7-k50-p0.9-m0.05": (0.7, 50, 0.9, 0.05),
          "t1.0": (1.0, 0, 1.0, 0.0), "t0.6-k20-p0.95": (0.6, 20, 0.95, 0.0)}
def dist(name, rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, V, device="cuda", generator=g)
    if name == "flat":
        return x * 0.64
    if name == "randn4":
        return x * 4
    # peaked: a real LM's shape, bulk N(0, 2.5) and a handful of strong candidates
    x = x * 2.5
    top = torch.randint(0, V, (rows, 8), device="cuda", generator=g)
    x.scatter_(1, top, 14 + 4 * torch.rand(rows, 8, device="cuda", generator=g))
    return x
def args(rows, vals):
    t, k, p, m = vals
    col = lambda v, d: torch.full((rows,), v, dtype=d, device="cuda")
    inv_t = col(1.0 / t, torch.float32); kk = col(k, torch.int32); pp = col(p, torch.float32)
    lmp = col(float(torch.log(torch.tensor(m))) if m > 0 else -float("inf"), torch.float32)
    seed = torch.arange(rows, device="cuda") * 1000 + 7; off = torch.full((rows,), 100, dtype=torch.long, device="cuda")
    return inv_t, kk, pp, lmp, seed, off
configs = [dict(block=2048, search_block=512, num_warps=8, prefetch=True)]
rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,8,64,256").split(",")]
out = []
print("| dist | params | rows | old µs | " + " | ".join(f"new b{c['block']}/s{c['search_block']}/w{c['num_warps']}/pf{int(c['prefetch'])} µs" for c in configs) + " | mismatches (vs old, vs ref) |")
for d in ("flat", "peaked"):
    for rows in rows_list:
        logits = dist(d, rows)
        for name, vals in PARAMS.items():
            a = args(rows, vals)
            t_old = triton.testing.do_bench(lambda: old.sample_tokens(logits, *a), warmup=5, rep=30)
            t_two = triton.testing.do_bench(lambda: two.sample_tokens(logits, *a, **configs[0]), warmup=5, rep=30)
            o = old.sample_tokens(logits, *a)
            ts = []
            mism = []
            for c in configs:
                ts.append(triton.testing.do_bench(lambda: new.sample_tokens(logits, *a, **c), warmup=5, rep=30))
                n = new.sample_tokens(logits, *a, **c)
                mism.append(int((n != o).sum()))
            r = ref.sample_tokens(logits[:8].cpu(), *(x[:8].cpu() for x in a))
            mref = int((n[:8].cpu() != r).sum())
            print(f"| {d} | {name} | {rows} | {t_old*1e3:.0f} | two sites {t_two*1e3:.0f} | " + " | ".join(f"{t*1e3:.0f}" for t in ts) + f" | {mism} / {mref} |", flush=True)
            out.append(dict(dist=d, params=name, rows=rows, old_us=t_old*1e3, new_us=[t*1e3 for t in ts], configs=configs, mism=mism, mism_ref=mref))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "cmp_sampler.json"), "w"), indent=1)
