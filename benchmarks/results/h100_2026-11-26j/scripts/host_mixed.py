"""Host time of the first (prefill) steps of the ShareGPT 256 run, by phase, on any device (tiny model). Scratch."""
import cProfile
import pstats
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
model = build_model(sys.argv[2] if len(sys.argv) > 2 else "tiny", dev, torch.bfloat16 if dev == "cuda" else torch.float32)
engine = hf_paged.Engine(model, max_num_seqs=256, max_num_batched_tokens=16384,
                         compile_decode=dev == "cuda")
engine.warm_up()
sched_fn, exec_fn = engine.scheduler.schedule, engine.runner.execute
t = {}


def timed(name, fn):
    def wrapper(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            t[name] = t.get(name, 0.0) + time.perf_counter() - s
    return wrapper


engine.scheduler.schedule = timed("schedule", sched_fn)
engine.runner.execute = timed("execute", exec_fn)
engine.runner.cache._make_step = timed("make_step", engine.runner.cache._make_step)
for seed in (0, 1):
    wl = make_workload("sharegpt", 256, seed)
    s = time.perf_counter()
    for p, n in wl:
        engine.add_request(p, max_new_tokens=n, ignore_eos=True)
    print(f"add_request x256 {1e3 * (time.perf_counter() - s):.1f} ms")
    prof = cProfile.Profile() if seed == 1 else None
    for i in range(4):
        t.clear()
        if prof:
            prof.enable()
        s = time.perf_counter()
        engine.step(finished_only=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - s
        if prof:
            prof.disable()
        print(f"seed {seed} step {i}: wall {wall * 1e3:.1f} ms " + " ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items()))
    while engine.has_unfinished():
        engine.step(finished_only=True)
st = pstats.Stats(prof)
st.sort_stats("tottime").print_stats("hf_paged/(core|engine|cache|scheduler|block|sequence)", 30)
st.sort_stats("cumulative").print_stats("hf_paged/(core|engine|cache)", 30)
