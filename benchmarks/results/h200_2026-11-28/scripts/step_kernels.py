"""The kernels of compiled decode steps, in order, with durations: one step each at several running counts of the
llama-1b ShareGPT greedy run (CUDA-only profiler around single steps)."""
import json
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
NAME = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
model = build_model(NAME, "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
workload = make_workload("sharegpt", 256, 0)
for prompt, n in workload:
    engine.add_request(prompt, max_new_tokens=n, ignore_eos=True)
res = {}
targets = [240, 64, 8]
step = 0
while engine.has_unfinished() and targets:
    running = sum(len(g.live_seqs()) for g in engine.scheduler.running)
    if step > 5 and running <= targets[0]:
        targets.pop(0)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step(finished_only=True)
            torch.cuda.synchronize()
        path = f"/tmp/trace_{running}.json"
        prof.export_chrome_trace(path)
        ev = json.load(open(path))["traceEvents"]
        gpu = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e],
                     key=lambda e: e["ts"])
        rows = [(e["name"][:90], e["ts"], e["dur"]) for e in gpu]
        res[running] = rows
        names = Counter(r[0] for r in rows)
        print(f"== running {running}: {len(rows)} GPU ops in 3 steps, span {(rows[-1][1] + rows[-1][2] - rows[0][1]):.0f} us")
        for name, c in names.most_common(40):
            tot = sum(r[2] for r in rows if r[0] == name)
            print(f"  {c:5d} x {tot / c:7.2f} us  {name}")
        step += 3
        continue
    engine.step(finished_only=True)
    step += 1
json.dump(res, open(f"{OUT}/step_kernels_{NAME}.json", "w"))
