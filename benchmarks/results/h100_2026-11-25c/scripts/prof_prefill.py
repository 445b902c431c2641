"""Profile the prefill steps of the qwen3 sampled workload (eager engine)."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..")); sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch
from bench_generate import build_model, make_workload

import hf_paged

model_name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
wl = sys.argv[2] if len(sys.argv) > 2 else "uniform"
workload = make_workload(wl, 256, 0)
model = build_model(model_name, "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=os.environ.get("COMPILED", "1") == "1")
engine.warm_up()
print("warm_up", engine.warm_up_seconds)
for p, n in workload:
    engine.add_request(p, max_new_tokens=n, ignore_eos=True, do_sample=True, temperature=0.6, top_p=0.95)
torch.cuda.synchronize()
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
walls = []
with torch.profiler.profile(activities=acts) as prof:
    for _ in range(4):
        t = time.perf_counter(); engine.step(finished_only=True); torch.cuda.synchronize(); walls.append(time.perf_counter() - t)
print("prefill step walls ms", [round(w * 1e3, 1) for w in walls])
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
engine.close()
