"""Where the issue's greedy run loses time against its bound, step by step: a CUDA+CPU profile of a whole run,
each GPU op attributed (through its launch's correlation id) to the engine step that launched it; per running-count
bin: GPU busy, GPU span (busy + idle up to the next step's first op) and the step's bound. Scratch."""
import bisect
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
MODEL = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
model = build_model(MODEL, "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, block_size=16, max_num_seqs=256, gpu_memory_utilization=0.9, compile_decode=True)
engine.warm_up()
cfg = model.config
L, Hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
kv_per_token = L * Hkv * D * 2 * 2
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"weights {weight_bytes / 1e9:.3f} GB, KV {kv_per_token} B/token", flush=True)

runner = engine.runner
exec_fn = runner.execute
log = []  # per execute: (label, rows, tokens, ctx_tokens)


def execute(sched, *args, **kwargs):
    items = sched.scheduled
    toks = sum(i.num_tokens for i in items)
    ctx = sum(i.start + i.num_tokens for i in items)
    decode = all(i.num_tokens == 1 for i in items)
    kind = ("pipe" if kwargs.get("input_tokens") is not None else "dec") if decode else "mixed"
    idx = len(log)
    log.append((kind, len(items), toks, ctx))
    with torch.profiler.record_function(f"exec#{idx}"):
        return exec_fn(sched, *args, **kwargs)


runner.execute = execute


def run(seed):
    wl = make_workload("sharegpt", 256, seed)
    for p, n in wl:
        engine.add_request(p, max_new_tokens=n, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


import gc  # noqa: E402

gc_log = []
_gc_t = [0.0]


def _gc_cb(phase, info):
    if phase == "start":
        _gc_t[0] = time.perf_counter()
    else:
        gc_log.append((info["generation"], time.perf_counter() - _gc_t[0], info.get("collected", 0)))


gc.callbacks.append(_gc_cb)
w0 = run(0)
log.clear()
w1 = run(1)
print(f"plain runs: seed0 {w0:.3f} s, seed1 {w1:.3f} s ({len(log)} executes)", flush=True)
by_gen = defaultdict(lambda: [0, 0.0, 0.0])
for g, d, _c in gc_log:
    by_gen[g][0] += 1
    by_gen[g][1] += d
    by_gen[g][2] = max(by_gen[g][2], d)
print("gc during two runs (gen: count, total ms, max ms):",
      {g: [v[0], round(v[1] * 1e3, 2), round(v[2] * 1e3, 2)] for g, v in by_gen.items()}, flush=True)
log.clear()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
                            ) as prof:
    w2 = run(2)
print(f"profiled run seed2 {w2:.3f} s ({len(log)} executes)", flush=True)
path = "/tmp/trace.json"
prof.export_chrome_trace(path)
ev = json.load(open(path))["traceEvents"]
ann = sorted([(e["ts"], e["ts"] + e["dur"], int(e["name"][5:])) for e in ev
              if e.get("cat") == "user_annotation" and e.get("name", "").startswith("exec#")])
starts = [a[0] for a in ann]
corr_step = {}
for e in ev:
    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e and "correlation" in e["args"]:
        i = bisect.bisect_right(starts, e["ts"]) - 1
        step = ann[i][2] if i >= 0 and e["ts"] <= ann[i][1] else None
        corr_step[e["args"]["correlation"]] = (step, e["name"])
gpu = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e],
             key=lambda e: e["ts"])
# attribute: a GPU op launched outside any execute (sampling picks, copies) goes to the last execute before it
per = defaultdict(lambda: {"busy": 0.0, "first": None, "last_end": 0.0, "n": 0})
last_step = None
unattrib = 0
for e in gpu:
    st, api = corr_step.get(e.get("args", {}).get("correlation"), (None, None))
    if st is None:
        st = last_step
        unattrib += 1
    if st is None:
        continue
    last_step = st if st is not None else last_step
    p = per[st]
    p["busy"] += e["dur"]
    p["n"] += 1
    p["first"] = e["ts"] if p["first"] is None else min(p["first"], e["ts"])
    p["last_end"] = max(p["last_end"], e["ts"] + e["dur"])
order = sorted(per, key=lambda s: per[s]["first"])
bins = defaultdict(lambda: defaultdict(float))
edges = (1, 9, 33, 97, 193)
gpu_first, gpu_last = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
tot = defaultdict(float)
for j, s in enumerate(order):
    kind, rows, toks, ctx = log[s]
    p = per[s]
    nxt = per[order[j + 1]]["first"] if j + 1 < len(order) else p["last_end"]
    span = nxt - p["first"]
    bound = 0.0 if kind == "mixed" else (weight_bytes + ctx * kv_per_token) / 3.0e12 * 1e6
    lo = max(b for b in edges if rows >= b)
    key = f"{kind}:{lo}"
    b = bins[key]
    b["steps"] += 1
    b["busy_us"] += p["busy"]
    b["span_us"] += span
    b["bound_us"] += bound
    b["ops"] += p["n"]
    b["rows"] += rows
    tot[kind + "_span"] += span
    tot[kind + "_busy"] += p["busy"]
    tot[kind + "_bound"] += bound
print(f"gpu span {(gpu_last - gpu_first) / 1e6:.3f} s, unattributed ops {unattrib}")
print(json.dumps({k: round(v / 1e6, 4) for k, v in tot.items()}, indent=1))
print("| bin | steps | mean rows | ops/step | busy us | span us | bound us | bound/span | busy/span |")
print("|---|---|---|---|---|---|---|---|---|")
for key in sorted(bins, key=lambda k: (k.split(":")[0], int(k.split(":")[1]))):
    b = bins[key]
    n = b["steps"]
    print(f"| {key} | {n:.0f} | {b['rows'] / n:.0f} | {b['ops'] / n:.0f} | {b['busy_us'] / n:.0f} | "
          f"{b['span_us'] / n:.0f} | {b['bound_us'] / n:.0f} | {b['bound_us'] / max(b['span_us'], 1):.0%} | "
          f"{b['busy_us'] / max(b['span_us'], 1):.0%} |")
# the largest idle gaps: which step's op follows, and its launch API
gaps = []
end = gpu[0]["ts"]
prev = None
for e in gpu:
    if e["ts"] > end + 5:
        st, api = corr_step.get(e.get("args", {}).get("correlation"), (None, None))
        gaps.append((e["ts"] - end, st, api, (prev or "")[:40], e["name"][:40]))
    end = max(end, e["ts"] + e["dur"])
    prev = e["name"]
gaps.sort(key=lambda g: -g[0])
bykind = defaultdict(lambda: [0, 0.0])
for g, st, api, *_ in gaps:
    k = (log[st][0] if st is not None else "none") + " " + str(api)
    bykind[k][0] += 1
    bykind[k][1] += g
print("gaps > 5 us by (step kind, launch API):", json.dumps({k: [v[0], round(v[1] / 1e3, 2)] for k, v in
                                                             sorted(bykind.items(), key=lambda kv: -kv[1][1])}))
for g in gaps[:25]:
    st = g[1]
    print(f"gap {g[0]:.0f} us step {st} {log[st] if st is not None else None} api {g[2]} after {g[3]} before {g[4]}")


def window(first, last, title):
    t_lo = min(a[0] for a in ann if first <= a[2] <= last)
    t_hi = max(a[1] for a in ann if first <= a[2] <= last) + 3000
    rows = []
    for e in ev:
        if "dur" not in e or not (t_lo <= e["ts"] <= t_hi):
            continue
        c = e.get("cat")
        if c in ("kernel", "gpu_memcpy", "gpu_memset"):
            rows.append((e["ts"], "GPU", e["name"][:60], e["dur"]))
        elif c in ("cuda_runtime", "cuda_driver", "user_annotation") or (c == "cpu_op" and e["dur"] > 30):
            rows.append((e["ts"], c[:8], e["name"][:60], e["dur"]))
    rows.sort()
    print(f"--- {title}: exec#{first}..#{last}")
    gpu_rows = 0
    for ts, c, name, dur in rows:
        if c == "GPU":
            gpu_rows += 1
            if gpu_rows % 40 not in (1, 2) and "Memcpy" not in name and "gather" not in name and "argmax" not in name:
                continue
        print(f"{(ts - t_lo):9.1f} {dur:8.1f} {c:8} {name}")


window(500, 502, "steady")
worst = [g for g in gaps if g[1] is not None and log[g[1]][0] == "pipe"][:2]
for g in worst:
    window(g[1] - 1, g[1], f"gap {g[0]:.0f} us")
api = defaultdict(lambda: [0, 0.0, 0.0])
for e in ev:
    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
        a = api[e["name"]]
        a[0] += 1
        a[1] += e["dur"]
        a[2] = max(a[2], e["dur"])
print("runtime API (count, total ms, max us):", json.dumps({k: [v[0], round(v[1] / 1e3, 2), round(v[2])] for k, v in
                                                            sorted(api.items(), key=lambda kv: -kv[1][1])[:14]}))
sizes = defaultdict(lambda: [0, 0.0])
for g, *_ in gaps:
    k = "<20" if g < 20 else ("<100" if g < 100 else ("<1000" if g < 1000 else ">=1000"))
    sizes[k][0] += 1
    sizes[k][1] += g
print("gap sizes (count, ms):", json.dumps({k: [v[0], round(v[1] / 1e3, 2)] for k, v in sizes.items()}))
json.dump({"bins": bins, "tot": tot, "gaps": gaps[:200], "log": log}, open(f"{OUT}/timeline2.json", "w"))
