"""Host stalls in the e2e loop: GC collections (count, time) per run, a run with gc disabled, and the longest steps."""
import gc
import json
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
events = []
state = {}


def cb(phase, info):
    if phase == "start":
        state["t"] = time.perf_counter()
    else:
        events.append((info["generation"], time.perf_counter() - state["t"], info.get("collected", 0)))


gc.callbacks.append(cb)


def run(label, disable):
    events.clear()
    params = [hf_paged.SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in workload]
    torch.cuda.synchronize()
    if disable:
        gc.disable()
    t0 = time.perf_counter()
    for (p, _), sp in zip(workload, params):
        engine.add_request(p, params=sp)
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step(finished_only=True)
        steps.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if disable:
        gc.enable()
    by_gen = {}
    for g, d, _ in events:
        c, tot = by_gen.get(g, (0, 0.0))
        by_gen[g] = (c + 1, tot + d)
    long = sorted(range(len(steps)), key=lambda i: -steps[i])[:12]
    row = {"label": label, "wall": wall, "steps": len(steps), "gc": {str(g): {"count": c, "ms": 1e3 * t}
                                                                        for g, (c, t) in by_gen.items()},
           "longest_steps_ms": [(i, round(1e3 * steps[i], 2)) for i in long],
           "steps_over_2_5ms": sum(1 for s in steps if s > 2.5e-3)}
    print(json.dumps(row), flush=True)
    return row


rows = [run("gc_on", False), run("gc_off", True), run("gc_on_again", False), run("gc_off_again", True)]
json.dump(rows, open(f"{OUT}/gc_probe.json", "w"), indent=1)
