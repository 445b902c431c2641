"""Kernels of steady decode steps of a compiled engine (CUDA activity): count per step, names of one step."""
import argparse
import collections
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload

import hf_paged

p = argparse.ArgumentParser()
p.add_argument("--model", default="llama-1b")
p.add_argument("--n", type=int, default=64)
p.add_argument("--steps", type=int, default=5)
a = p.parse_args()
model = build_model(a.model, "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
for prompt, n in make_workload("sharegpt", a.n, 0):
    engine.add_request(prompt, max_new_tokens=max(n, 64), ignore_eos=True)
for _ in range(12):
    engine.step(finished_only=True)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(a.steps):
        engine.step(finished_only=True)
    torch.cuda.synchronize()
events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
events.sort(key=lambda e: e.time_range.start)
names = collections.Counter(e.name[:90] for e in events)
print(f"{a.model}: {len(events)} GPU ops in {a.steps} steps ({len(events) / a.steps:.1f} per step)")
for name, c in names.most_common(40):
    print(f"{c / a.steps:7.2f}  {name}")
engine.close()
