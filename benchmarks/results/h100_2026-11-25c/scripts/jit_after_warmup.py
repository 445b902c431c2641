"""Do serving steps compile Triton kernels that warm_up() did not? (device)"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..")); sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch
from bench_generate import build_model, make_workload

import hf_paged
from hf_paged import kernels

if os.environ.get("ALL_LENGTHS") == "1":
    kernels.prefill_tile_lengths = lambda h, kv, d, m, dev: [2 ** i for i in range(1, 10) if 2 ** i <= max(2, m)]
from hf_paged.kernels import triton_decode, triton_prefill, triton_sampling


def counts():
    out = {}
    for name, k in (("prefill", triton_prefill._paged_prefill_kernel), ("decode", triton_decode._paged_decode_kernel),
                    ("sample", triton_sampling._sample_kernel)):
        out[name] = sum(len(c[0]) for c in k.device_caches.values())
    return out
model = build_model(sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
t = time.perf_counter(); engine.warm_up(); print("warm_up", round(time.perf_counter() - t, 2), engine.warm_up_seconds)
print("after warm_up", counts())
wl = make_workload("uniform", 128, 0)
t = time.perf_counter()
for p, n in wl:
    engine.add_request(p, max_new_tokens=min(n, 64), ignore_eos=True, do_sample=True, temperature=0.6, top_p=0.95)
while engine.has_unfinished():
    engine.step(finished_only=True)
torch.cuda.synchronize()
print("run", round(time.perf_counter() - t, 2), "after run", counts())
