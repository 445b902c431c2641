"""Dump every GPU kernel (name, start, duration) of a window of steady decode steps, for a per-step listing."""
import argparse
import csv
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload

import hf_paged

p = argparse.ArgumentParser()
p.add_argument("--model", default="llama-1b"); p.add_argument("--until", type=int, nargs="+", default=[0])
p.add_argument("--steps", type=int, default=20); p.add_argument("--out", required=True)
p.add_argument("--n", type=int, default=256)
a = p.parse_args()
model = build_model(a.model, "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
for prompt, n in make_workload("sharegpt", a.n, 0):
    engine.add_request(prompt, max_new_tokens=n, ignore_eos=True)
while engine.scheduler.waiting or any(s.is_prefill for g in engine.scheduler.running for s in g.live_seqs()):
    engine.step()
for _ in range(5):
    engine.step()
for until in a.until:
    while until and engine.scheduler.num_running_seqs() > until:
        engine.step()
    torch.cuda.synchronize()
    running = engine.scheduler.num_running_seqs()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / a.steps
    rows = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda r: r[1])
    with open(f"{a.out}_{running}.csv", "w", newline="") as f:
        w = csv.writer(f); w.writerow(["name", "start_us", "dur_us"]); w.writerows(rows)
    print(f"{a.model}: running {running}, wall per step {wall*1000:.3f} ms, {len(rows)} kernels in {a.steps} steps")
engine.close()
