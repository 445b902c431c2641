"""cProfile of compiled prefill steps (qwen3 sampled workload, device)."""
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..")); sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch
from bench_generate import build_model, make_workload

import hf_paged

workload = make_workload("uniform", 256, 0)
model = build_model("qwen3-0.6b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
for p, n in workload:
    engine.add_request(p, max_new_tokens=n, ignore_eos=True, do_sample=True, temperature=0.6, top_p=0.95)
torch.cuda.synchronize()
engine.step(finished_only=True); torch.cuda.synchronize()
walls = []
pr = cProfile.Profile()
for _ in range(6):
    t = time.perf_counter()
    pr.enable(); engine.step(finished_only=True); torch.cuda.synchronize(); pr.disable()
    walls.append(round((time.perf_counter() - t) * 1e3, 1))
print("prefill step walls ms (cProfile on)", walls, "compiled prefill steps", engine.runner.compiled_prefill_steps)
# the same steps without the profiler
walls = []
for _ in range(6):
    t = time.perf_counter(); engine.step(finished_only=True); torch.cuda.synchronize(); walls.append(round((time.perf_counter() - t) * 1e3, 1))
print("next steps walls ms (no profiler)", walls, "waiting", len(engine.scheduler.waiting))
pstats.Stats(pr).sort_stats("tottime").print_stats(30)
pstats.Stats(pr).sort_stats("cumulative").print_stats(40)
