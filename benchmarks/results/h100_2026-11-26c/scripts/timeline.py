"""Where the e2e ShareGPT greedy run's time goes: GPU busy vs idle (CUDA-only profiler over the whole run), kernel
categories per running-count bin with KV bytes, then a decode-kernel config sweep at the run's own lengths."""
import json
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

OUT = sys.argv[1]
SWEEP = "--no-sweep" not in sys.argv
PROFILE = "--no-profile" not in sys.argv
model = build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
workload = make_workload("sharegpt", 256, 0)
res = {}


def lens_now():
    return [len(s.token_ids) for g in engine.scheduler.running for s in g.live_seqs()]


def run(record):
    for prompt, n in workload:
        engine.add_request(prompt, max_new_tokens=n, ignore_eos=True)
    snaps, steps = {}, []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        if record:
            lens = lens_now()
            steps.append((time.perf_counter() - t0, len(lens), sum(lens)))
            for th in (256, 200, 128, 96, 64, 24, 8):
                if th not in snaps and 0 < len(lens) <= th and engine.stats["steps"] > 3:
                    snaps[th] = lens
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, snaps, steps


wall, _, _ = run(False)
wall2, snaps, steps = run(True)
res["wall_plain"], res["wall_recording"] = wall, wall2
print(f"wall {wall:.3f} s (recording lens {wall2:.3f})", flush=True)

if PROFILE:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall3, _, _ = run(False)
    res["wall_profiled"] = wall3
    path = f"{OUT}/trace.json"
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    import os
    os.remove(path)
    gpu = sorted([e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e],
                 key=lambda e: e["ts"])
    t_first, t_last = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    busy, end, gaps = 0.0, gpu[0]["ts"], defaultdict(lambda: [0, 0.0])
    prev = None
    cat_time = defaultdict(float)
    for e in gpu:
        s, d = e["ts"], e["dur"]
        name = e["name"]
        if "paged_decode" in name:
            c = "attn_decode"
        elif "prefill" in name:
            c = "attn_prefill"
        elif "nvjet" in name or "gemm" in name.lower() or "cutlass" in name or "splitK" in name:
            c = "gemm_big" if d > 100 else "gemm"
        elif name.startswith("triton_"):
            c = "inductor"
        elif "argmax" in name or "reduce_kernel" in name:
            c = "pick"
        elif "Memcpy" in name or "Memset" in name:
            c = "copy"
        else:
            c = "other:" + name[:40]
        cat_time[c] += d
        if s > end:
            g = s - end
            key = f"{prev[:30] if prev else None} -> {name[:30]}"
            bucket = "gap<2us" if g < 2 else ("gap2-10" if g < 10 else ("gap10-100" if g < 100 else "gap>100"))
            gaps[bucket][0] += 1
            gaps[bucket][1] += g
            if g >= 10:
                gaps["big:" + key][0] += 1
                gaps["big:" + key][1] += g
            busy += d
            end = s + d
        else:
            busy += max(0.0, s + d - end)
            end = max(end, s + d)
        prev = name
    res["gpu_span_s"] = (t_last - t_first) / 1e6
    res["gpu_busy_s"] = busy / 1e6
    res["categories_s"] = {k: v / 1e6 for k, v in sorted(cat_time.items(), key=lambda kv: -kv[1])}
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:25]
    res["gaps"] = {k: {"count": v[0], "total_ms": v[1] / 1e3} for k, v in top}
    print(json.dumps({k: res[k] for k in ("wall_profiled", "gpu_span_s", "gpu_busy_s")}, indent=1))
    print(json.dumps(res["categories_s"], indent=1))
    print(json.dumps(res["gaps"], indent=1), flush=True)

# per-bin step counts and KV bytes from the recorded run
bins = defaultdict(lambda: [0, 0, 0.0])
for i, (t, n, toks) in enumerate(steps):
    lo = next(b for b in (1, 9, 33, 97, 193) if n < {1: 9, 9: 33, 33: 97, 97: 193, 193: 10**9}[b])
    bins[lo][0] += 1
    bins[lo][1] += toks
    if i + 1 < len(steps):
        bins[lo][2] += steps[i + 1][0] - t
res["bins"] = {k: {"steps": v[0], "mean_ctx_tokens": v[1] / max(v[0], 1), "wall_ms_per_step": 1e3 * v[2] / max(v[0], 1)}
               for k, v in sorted(bins.items())}
print(json.dumps(res["bins"], indent=1), flush=True)
res["snap_summary"] = {k: {"n": len(v), "mean": sum(v) / len(v), "max": max(v)} for k, v in snaps.items()}
print(json.dumps(res["snap_summary"], indent=1), flush=True)
json.dump(res, open(f"{OUT}/timeline.json", "w"), indent=1)

if not SWEEP:
    sys.exit(0)
# ---------------------------------------------------------------- decode kernel sweep at the run's own lengths
from bench_decode_splits import graph_time_us  # noqa: E402

from hf_paged.kernels import triton_decode as td  # noqa: E402

mb = engine.runner.max_blocks_per_seq
engine.close()
engine = model = None  # (was `del engine, model` as run; ruff reads a del as undefining)
torch.cuda.empty_cache()
Hq, Hkv, D, bs, L = 32, 8, 64, 16, 16
buckets = [1, 2, 4, 8] + list(range(16, 129, 16)) + list(range(160, 257, 32))
sweep = {}
for th, lens in sorted(snaps.items(), reverse=True):
    n = len(lens)
    B = next(b for b in buckets if b >= n)
    need = sum((x + bs) // bs for x in lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(L):
        kc = torch.randn(need + 1, Hkv, bs, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        perm = torch.randperm(need, device="cuda", generator=g).to(torch.int32)
        bt = torch.zeros(B, mb, dtype=torch.int32, device="cuda")
        at = 0
        for r, x in enumerate(lens):
            k = (x + bs) // bs
            bt[r, :k] = perm[at:at + k]
            at += k
        layers.append((kc, vc, bt))
    seq = torch.zeros(B, dtype=torch.int32, device="cuda")
    seq[:n] = torch.tensor(lens, dtype=torch.int32) + 1
    slots = torch.full((B,), -1, dtype=torch.long, device="cuda")
    slots[:n] = torch.tensor([int(layers[0][2][r, x // bs]) * bs + x % bs for r, x in enumerate(lens)],
                             dtype=torch.long)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn_like(kn)
    out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(B * Hkv, dtype=torch.int32, device="cuda")
    kv_bytes = sum(x + 1 for x in lens) * Hkv * D * 2 * 2
    bound_us = kv_bytes / 3.0e12 * 1e6
    heur = td.default_num_splits(B, Hkv, D, mb * bs, q.device)
    rows = {}
    configs = [(None, None, None, None)]
    for bn in (32, 64, 128):
        for w in (2, 4, 8):
            for st in (1, 2, 3):
                configs.append((bn, w, st, None))
    for sp in sorted({1, 2, 4, 8, 16, heur * 2, max(1, heur // 2)}):
        configs.append((64, 4, 2, sp))
        configs.append((128, 4, 2, sp))
    for bn, w, st, sp in configs:
        def call(bn=bn, w=w, st=st, sp=sp):
            for kc, vc, bt in layers:
                td.paged_decode(q, kc, vc, bt, seq, 0.125, num_splits=sp, block_n=bn, num_warps=w, num_stages=st,
                                max_context=mb * bs, out=out, new_kv=(kn, vn, slots), split_counters=counters)
        try:
            us = graph_time_us(call, calls=1, replays=30) / L
        except Exception as error:  # a config that does not compile / fit
            rows[str((bn, w, st, sp))] = str(error)[:80]
            continue
        rows[str((bn, w, st, sp))] = round(us, 2)
    best = min((v, k) for k, v in rows.items() if isinstance(v, float))
    sweep[th] = {"n": n, "bucket": B, "mean_len": sum(lens) / n, "bound_us": bound_us, "heuristic_splits": heur,
                 "default_us": rows[str((None, None, None, None))], "best": best, "rows": rows}
    print(th, n, B, f"bound {bound_us:.1f} default {rows[str((None, None, None, None))]} best {best}", flush=True)
    layers = None  # (was `del layers` as run)
    torch.cuda.empty_cache()
res["sweep"] = sweep
json.dump(res, open(f"{OUT}/timeline.json", "w"), indent=1)
