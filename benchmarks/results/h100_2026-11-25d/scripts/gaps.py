"""Per-step GPU busy / GPU idle / host phases of a pipelined engine run, by batch bin (device, one process).

GPU busy = from an event right before the graph replay to an event right after the pick's copy (pure GPU work);
GPU idle = from the previous step's end event to this step's start event (the GPU waiting for the host, plus the
small input copies). Host phases by perf_counter wrappers.
    python benchmarks/scratch/gaps.py llama-1b sharegpt 0
"""
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch  # noqa: E402
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

model_name, wl, temp = sys.argv[1], sys.argv[2], float(sys.argv[3])
n_req = int(sys.argv[4]) if len(sys.argv) > 4 else 256
workload = make_workload(wl, n_req, 0)
model = build_model(model_name, "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
kw = dict(do_sample=True, temperature=temp, top_p=0.95) if temp > 0 else {}
runner = engine.runner
for b, f in list(runner._graphs.items()):
    if f is None:
        continue

    def wrapped(f=f):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        cur["s"] = e
        return f()

    runner._graphs[b] = wrapped
cur = {}
steps = []  # dict per step
host = defaultdict(float)


def timed(obj, name, key):
    fn = getattr(obj, name)

    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            cur.setdefault("h", defaultdict(float))[key] += time.perf_counter() - t

    setattr(obj, name, w)


launch_fn = engine._launch


def launch(sched, logits):
    t = time.perf_counter()
    out = launch_fn(sched, logits)
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    cur.setdefault("h", defaultdict(float))["launch"] += time.perf_counter() - t
    cur["e"] = e
    cur["n"] = len(sched.scheduled)
    return out


engine._launch = launch
apply_fn = engine._apply


def apply(current):
    t = time.perf_counter()
    if current.event is not None:
        current.event.synchronize()
    t2 = time.perf_counter()
    out = apply_fn(current)
    h = cur.setdefault("h", defaultdict(float))
    h["wait"] += t2 - t
    h["apply"] += time.perf_counter() - t2
    return out


engine._apply = apply
timed(engine.scheduler, "schedule_decode_step", "schedule")
timed(engine.scheduler, "schedule", "schedule")
timed(runner, "apply_block_ops", "block_ops")
timed(runner, "execute", "execute")
timed(engine, "_track", "track")
timed(engine, "_outputs", "outputs")
for p, n in workload:
    engine.add_request(p, max_new_tokens=n, ignore_eos=True, **kw)
torch.cuda.synchronize()
t0 = time.perf_counter()
while engine.has_unfinished():
    cur.clear()
    t = time.perf_counter()
    engine.step(finished_only=True)
    wall = time.perf_counter() - t
    if "s" in cur and "e" in cur:
        steps.append((cur["n"], cur["s"], cur["e"], wall, dict(cur["h"])))
torch.cuda.synchronize()
total = time.perf_counter() - t0
print(f"{model_name} {wl} T{temp}: wall {total:.3f} s, recorded steps {len(steps)}")
rows = []
for i, (n, s, e, wall, h) in enumerate(steps):
    busy = s.elapsed_time(e)
    idle = steps[i - 1][2].elapsed_time(s) if i else 0.0
    rows.append((n, busy, idle, wall * 1000, {k: v * 1000 for k, v in h.items()}))
keys = ["schedule", "block_ops", "execute", "launch", "wait", "apply", "track", "outputs"]
print("| batch | steps | GPU busy ms | GPU idle ms | step wall ms | host ms (no wait) | " + " | ".join(keys) + " |")
for lo, hi in ((1, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 10**6)):
    sel = [r for r in rows if lo <= r[0] <= hi]
    if not sel:
        continue
    m = len(sel)
    hs = {k: sum(r[4].get(k, 0) for r in sel) / m for k in keys}
    hostsum = sum(v for k, v in hs.items() if k != "wait")
    print(f"| {lo}-{hi} | {m} | {sum(r[1] for r in sel) / m:.3f} | {sum(r[2] for r in sel) / m:.3f} | "
          f"{sum(r[3] for r in sel) / m:.3f} | {hostsum:.3f} | " + " | ".join(f"{hs[k]:.3f}" for k in keys) + " |")
print(f"GPU busy total {sum(r[1] for r in rows) / 1e3:.3f} s, idle total {sum(r[2] for r in rows) / 1e3:.3f} s")
engine.close()
