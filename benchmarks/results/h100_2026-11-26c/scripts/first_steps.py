"""What the first run's first steps pay that later runs do not: each of steps 0-4 profiled (CPU + CUDA)."""
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

OUT = sys.argv[1]
model = build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True, enable_prefix_caching=False)
engine.warm_up()
workload = make_workload("sharegpt", 256, 0)
for run in range(2):
    for p, n in workload:
        engine.add_request(p, params=hf_paged.SamplingParams(max_new_tokens=n, ignore_eos=True))
    torch.cuda.synchronize()
    for step in range(5):
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            t = time.perf_counter()
            engine.step(finished_only=True)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        print(f"=== run {run} step {step}: {wall * 1e3:.1f} ms", flush=True)
        if run == 0 or step == 3:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    while engine.has_unfinished():
        engine.step(finished_only=True)
