"""Host work of prefill steps: cProfile over prefill steps of a compiled llama-1b engine (long or sharegpt workload),
and GPU idle per step from CUDA events."""
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(1, os.path.join(os.getcwd(), "benchmarks"))
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

kind = sys.argv[1]
model = build_model("llama-1b", "cuda", torch.bfloat16, max_len=16384)
engine = hf_paged.Engine(model, compile_decode=True)
engine.runner.compile_prefill = True
engine.warm_up()
wl = make_workload(kind, 64 if kind == "long" else 256, 1)
for p, n in wl:
    engine.add_request(p, max_new_tokens=n, ignore_eos=True)
engine.step(finished_only=True)
torch.cuda.synchronize()
n = 6 if kind == "long" else 2
prof = cProfile.Profile()
walls = []
for i in range(n):
    t = time.perf_counter()
    if i == n - 1:
        prof.enable()
    engine.step(finished_only=True)
    if i == n - 1:
        prof.disable()
    walls.append(time.perf_counter() - t)
torch.cuda.synchronize()
print("step walls ms", [round(w * 1000, 1) for w in walls], "stats", {k: v for k, v in engine.stats.items()
                                                                        if "tokens" in k or k == "steps"})
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(35)
st.sort_stats("tottime").print_stats(20)
