"""Kernels of compiled decode steps by total time per step, at several running counts (ShareGPT greedy run of a
named shape). Usage: step_kernels.py MODEL [targets...]"""
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
name = sys.argv[1]
targets = [int(t) for t in sys.argv[2:]] or [200, 64, 24]
model = build_model(name, "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
for prompt, n in make_workload("sharegpt", 256, 0):
    engine.add_request(prompt, max_new_tokens=n, ignore_eos=True)
res = {}
step = 0
while engine.has_unfinished() and targets:
    running = sum(len(g.live_seqs()) for g in engine.scheduler.running)
    if step > 5 and running <= targets[0]:
        targets.pop(0)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                engine.step(finished_only=True)
            torch.cuda.synchronize()
        path = f"/tmp/trace_{running}.json"
        prof.export_chrome_trace(path)
        ev = json.load(open(path))["traceEvents"]
        gpu = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e],
                     key=lambda e: e["ts"])
        rows = [(e["name"][:100], e["ts"], e["dur"]) for e in gpu]
        res[running] = rows
        tot, cnt = defaultdict(float), defaultdict(int)
        for r in rows:
            tot[r[0]] += r[2]
            cnt[r[0]] += 1
        busy = sum(r[2] for r in rows)
        span = rows[-1][1] + rows[-1][2] - rows[0][1]
        print(f"== {name} running {running}: {len(rows) / 4:.0f} GPU ops/step, busy {busy / 4:.0f} us/step, "
              f"span {span / 4:.0f} us/step")
        for k in sorted(tot, key=tot.get, reverse=True)[:25]:
            print(f"  {tot[k] / 4:8.1f} us/step {cnt[k] / 4:6.1f} x {tot[k] / cnt[k]:7.2f} us  {k}")
        step += 4
        continue
    engine.step(finished_only=True)
    step += 1
json.dump(res, open(f"{OUT}/step_kernels_{name}.json", "w"))
