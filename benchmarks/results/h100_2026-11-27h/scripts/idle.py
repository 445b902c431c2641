"""Where a ShareGPT greedy run's time goes: GPU busy per step against its bytes' bound, GPU idle between steps, and
the host's phases per step. CUDA events at each execute's entry (S) and after each step's last GPU work (E); the
idle before step N+1 is S(N+1) - E(N) (zero when the host launched it before the GPU got there)."""
import argparse
import json
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload
from roofline import copy_bandwidth, model_bytes

import hf_paged

p = argparse.ArgumentParser()
p.add_argument("--model", default="llama-1b")
p.add_argument("--workload", default="sharegpt")
p.add_argument("--n", type=int, default=256)
p.add_argument("--out", required=True)
p.add_argument("--runs", type=int, default=2)
p.add_argument("--temperature", type=float, default=0.0)
p.add_argument("--top-p", type=float, default=1.0)
a = p.parse_args()

model = build_model(a.model, "cuda", torch.bfloat16)
bw = copy_bandwidth("cuda")
wbytes = model_bytes(model)
kv_token = hf_paged.cache.kv_bytes_per_token(model.config, torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
torch.cuda.synchronize()
workload = make_workload(a.workload, a.n, 0)

records = []  # per execute: dict
cur = {}


def ev():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


host = defaultdict(float)


def timed(obj, name, key):
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            host[key] += time.perf_counter() - t

    setattr(obj, name, wrapper)


exec_fn = engine.runner.execute


def execute(sched, *args, **kwargs):
    t = time.perf_counter()
    rec = {"S": ev(), "batch": len(sched.scheduled),
           "decode": all(item.num_tokens == 1 for item in sched.scheduled),
           "pipelined": kwargs.get("input_tokens") is not None}
    b = sched.batch
    if b is not None:
        rec["ctx"] = int(np.asarray(b.starts).sum()) + rec["batch"]
    else:
        rec["ctx"] = sum(item.start + item.num_tokens for item in sched.scheduled)
    rec["tokens"] = sum(item.num_tokens for item in sched.scheduled)
    out = exec_fn(sched, *args, **kwargs)
    rec["X"] = ev()
    rec["exec_s"] = time.perf_counter() - t
    records.append(rec)
    return out


engine.runner.execute = execute
launch_fn = engine._launch


def launch(*args, **kwargs):
    out = launch_fn(*args, **kwargs)
    records[-1]["E"] = ev()
    return out


engine._launch = launch
su_fn = engine._sample_and_update


def sample_and_update(*args, **kwargs):
    out = su_fn(*args, **kwargs)
    if "E" not in records[-1]:
        records[-1]["E"] = ev()
    return out


engine._sample_and_update = sample_and_update
timed(engine, "_apply", "apply (wait+update)")
timed(engine, "_outputs", "outputs")
timed(engine, "_track", "track")
timed(engine.runner, "_upload_tables", "upload_tables")
_sync = torch.cuda.Event.synchronize


def _timed_sync(self):
    t = time.perf_counter()
    try:
        return _sync(self)
    finally:
        host["wait (event sync)"] += time.perf_counter() - t


torch.cuda.Event.synchronize = _timed_sync
timed(engine.scheduler, "schedule_decode_step", "schedule_decode_step")
timed(engine.scheduler, "schedule", "schedule (full)")
timed(engine.runner, "apply_block_ops", "apply_block_ops")
timed(engine, "_launch", "launch (pick+copy)")
step_fn = engine.step
stepwall = [0.0]


per_step = []


def step(*args, **kwargs):
    before = dict(host)
    n = len(records)
    t = time.perf_counter()
    try:
        return step_fn(*args, **kwargs)
    finally:
        dt = time.perf_counter() - t
        stepwall[0] += dt
        delta = {k: v - before.get(k, 0.0) for k, v in host.items()}
        batch = records[-1]["batch"] if len(records) > n else 0
        per_step.append((batch, dt, delta))


engine.step = step
results = []
for run in range(a.runs):
    records.clear()
    per_step.clear()
    host.clear()
    stepwall[0] = 0.0
    kw = {}
    if a.temperature:
        kw = dict(do_sample=True, temperature=a.temperature, top_p=a.top_p)
    params = [hf_paged.SamplingParams(max_new_tokens=o, ignore_eos=True, **kw) for _, o in workload]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start = ev()
    for (pr, _), sp in zip(workload, params):
        engine.add_request(pr, params=sp)
    while engine.has_unfinished():
        engine.step(finished_only=True)
    end = ev()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    total_gpu = start.elapsed_time(end) / 1000
    prev_end = start
    bins = defaultdict(lambda: defaultdict(float))
    idle_total = busy_total = 0.0
    for r in records:
        e = r.get("E", r["X"])
        idle = max(0.0, prev_end.elapsed_time(r["S"]) / 1000)
        busy = r["S"].elapsed_time(e) / 1000
        prev_end = e
        idle_total += idle
        busy_total += busy
        if not r["decode"]:
            key = "prefill"
            bound = 0.0
        else:
            bt = r["batch"]
            key = next(f"{lo}-{hi}" for lo, hi in ((1, 8), (9, 32), (33, 96), (97, 160), (161, 224), (225, 10**6))
                       if lo <= bt <= hi)
            bound = (wbytes + kv_token * r["ctx"]) / bw
        d = bins[key]
        d["steps"] += 1
        d["busy_s"] += busy
        d["idle_before_s"] += idle
        d["bound_s"] += bound
        d["exec_s"] += r["exec_s"]
        d["rows"] += r["batch"]
    tail_idle = max(0.0, prev_end.elapsed_time(end) / 1000)
    res = {"run": run, "wall_s": wall, "gpu_span_s": total_gpu, "busy_s": busy_total, "idle_s": idle_total,
           "tail_idle_s": tail_idle, "step_wall_s": stepwall[0], "host": dict(host),
           "bins": {k: dict(v) for k, v in bins.items()}, "steps": len(records)}
    results.append(res)
    print(f"run {run}: wall {wall:.3f} s, GPU span {total_gpu:.3f}, busy {busy_total:.3f}, idle {idle_total:.3f} "
          f"(+tail {tail_idle:.3f}), steps {len(records)}, engine.step wall {stepwall[0]:.3f}")
    print("  host:", {k: round(v, 3) for k, v in host.items()})
    print(f"  {'bin':>9} {'steps':>6} {'rows':>6} {'busy ms':>8} {'bound ms':>8} {'frac':>5} {'idle ms':>8} "
          f"{'exec ms':>8} {'busy s':>7} {'idle s':>7} {'bound s':>7}")
    for k in ["prefill", "1-8", "9-32", "33-96", "97-160", "161-224", "225-1000000"]:
        if k not in bins:
            continue
        d = bins[k]
        n = d["steps"]
        frac = d["bound_s"] / d["busy_s"] if d["bound_s"] else 0
        print(f"  {k:>9} {int(n):>6} {d['rows']/n:>6.1f} {1000*d['busy_s']/n:>8.3f} {1000*d['bound_s']/n:>8.3f} "
              f"{frac:>5.0%} {1000*d['idle_before_s']/n:>8.3f} {1000*d['exec_s']/n:>8.3f} {d['busy_s']:>7.3f} "
              f"{d['idle_before_s']:>7.3f} {d['bound_s']:>7.3f}")
    hb = defaultdict(lambda: defaultdict(float))
    for batch, dt, delta in per_step:
        key = next(f"{lo}-{hi}" for lo, hi in ((0, 0), (1, 8), (9, 32), (33, 96), (97, 160), (161, 224), (225, 10**6))
                   if lo <= batch <= hi)
        d = hb[key]
        d["n"] += 1
        d["wall"] += dt
        d["host"] += dt - delta.get("wait (event sync)", 0.0)
        for k, v in delta.items():
            d[k] += v
    res["host_bins"] = {k: dict(v) for k, v in hb.items()}
    print("  per-step host (ms, step launched in the bin):")
    for k, d in hb.items():
        n = d["n"]
        parts = ", ".join(f"{name} {1000 * d[name] / n:.3f}" for name in sorted(d) if name not in ("n",))
        print(f"   {k:>9} n={int(n)}: {parts}")
json.dump({"model": a.model, "bw": bw, "weight_bytes": wbytes, "kv_token": kv_token, "runs": results},
          open(f"{a.out}/idle_{a.model}.json", "w"), indent=1)
engine.close()
