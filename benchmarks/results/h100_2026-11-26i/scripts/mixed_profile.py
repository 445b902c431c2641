"""Where a mixed step's time goes (prefill of new prompts + ~250 decodes, off the graph path): llama-1b, compiled
engine, Alpaca-like 1000 requests. Per-step wall with and without a sync, then a CPU+CUDA profile of a few steps."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
model = build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
for prompt, n in make_workload("alpaca", 1000, 0):
    engine.add_request(prompt, max_new_tokens=n, ignore_eos=True)
runner = engine.runner
kinds = []
orig_execute = runner.execute


def execute(sched, *a, **k):
    pre = sum(it.num_tokens for it in sched.scheduled if it.num_tokens > 1)
    kinds.append((len(sched.scheduled), pre))
    return orig_execute(sched, *a, **k)


runner.execute = execute
for _ in range(8):
    engine.step()
# per-step wall, synchronised: mixed vs decode
rows = []
for _ in range(60):
    torch.cuda.synchronize()
    n0 = len(kinds)
    t = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    rows.append((time.perf_counter() - t, kinds[n0:]))
mixed = [r[0] * 1e3 for r in rows if any(p for _, p in r[1])]
dec = [r[0] * 1e3 for r in rows if r[1] and not any(p for _, p in r[1])]
print(f"synced steps: mixed {len(mixed)} mean {sum(mixed) / max(len(mixed), 1):.2f} ms; decode {len(dec)} mean "
      f"{sum(dec) / max(len(dec), 1):.2f} ms")
print("first rows", [(round(r[0] * 1e3, 2), r[1]) for r in rows[:12]])
# profile 12 steps
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(12):
        engine.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
prof.export_chrome_trace(f"{OUT}/mixed_trace.json")
ev = json.load(open(f"{OUT}/mixed_trace.json"))["traceEvents"]
gpu = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e], key=lambda e: e["ts"])
busy = sum(e["dur"] for e in gpu)
span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
print(f"profiled 12 steps: GPU busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms span; kinds {kinds[-12:]}")
os.remove(f"{OUT}/mixed_trace.json")
