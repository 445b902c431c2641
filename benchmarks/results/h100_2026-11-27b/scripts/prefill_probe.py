"""Long-prompt prefill: (1) the kernels of a few prefill steps of the llama-1b long workload, by total time; (2) the
paged prefill kernel's launch configurations on one 16k-token chunk of long prompts, TFLOP/s."""
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, "benchmarks")
from bench_decode_splits import graph_time_us  # noqa: E402
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.kernels import triton_prefill  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
part = sys.argv[1] if len(sys.argv) > 1 else "both"

if part in ("both", "profile"):
    model = build_model("llama-1b", "cuda", torch.bfloat16, max_len=16384)
    engine = hf_paged.Engine(model)
    engine.warm_up()
    for prompt, n in make_workload("long", 64, 0):
        engine.add_request(prompt, max_new_tokens=n, ignore_eos=True)
    for _ in range(2):
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step(finished_only=True)
        torch.cuda.synchronize()
    prof.export_chrome_trace("/tmp/prefill.json")
    ev = json.load(open("/tmp/prefill.json"))["traceEvents"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    tot, cnt = defaultdict(float), defaultdict(int)
    for e in gpu:
        tot[e["name"][:90]] += e["dur"]
        cnt[e["name"][:90]] += 1
    busy = sum(tot.values())
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    print(f"== 3 prefill steps: busy {busy / 1e3:.1f} ms, span {span / 1e3:.1f} ms")
    for k in sorted(tot, key=tot.get, reverse=True)[:14]:
        print(f"  {tot[k] / 1e3:8.2f} ms {cnt[k]:5d} x {tot[k] / cnt[k]:8.1f} us  {k}")
    del engine, model
    torch.cuda.empty_cache()

if part in ("both", "sweep"):
    bs = 16
    for hq, hkv, d in ((32, 8, 64), (16, 8, 128), (32, 8, 128)):
        seqs = [(5000, 5000), (7000, 7000), (4384, 4384)]  # (query tokens, context): one 16,384-token chunk
        nblocks = sum((c + bs - 1) // bs for _, c in seqs) + 1
        kc = torch.randn(nblocks, hkv, bs, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        width = max((c + bs - 1) // bs for _, c in seqs)
        bt = torch.zeros(len(seqs), width, dtype=torch.int32, device="cuda")
        perm = torch.randperm(nblocks - 1, device="cuda").to(torch.int32)
        at = 0
        for i, (_, c) in enumerate(seqs):
            k = (c + bs - 1) // bs
            bt[i, :k] = perm[at:at + k]
            at += k
        T = sum(q for q, _ in seqs)
        q = torch.randn(T, hq, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0] + list(torch.tensor([s[0] for s in seqs]).cumsum(0)), dtype=torch.int32, device="cuda")
        sl = torch.tensor([c for _, c in seqs], dtype=torch.int32, device="cuda")
        flops = sum(4.0 * hq * d * (c - qn) * qn + 4.0 * hq * d * qn * (qn + 1) / 2 for qn, c in seqs)
        base = triton_prefill._config(hq // hkv, d, max(s[0] for s in seqs), True)
        print(f"== prefill kernel Hq {hq} Hkv {hkv} d {d}, {T} query tokens, {flops / 1e12:.2f} TFLOP; "
              f"config now {base}")
        for cfg in [None, (128, 64, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                    (128, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (256, 64, 8, 2), (128, 64, 4, 4)]:
            opts = {} if cfg is None else dict(block_m=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
            try:
                us = graph_time_us(lambda: triton_prefill.paged_prefill(q, kc, vc, bt, cu, sl, d**-0.5, max(s[0] for s in seqs),
                                                               **opts), calls=3, replays=10)
                print(f"  {str(cfg or 'default'):22s} {us:9.1f} us  {flops / us / 1e6:6.1f} TFLOP/s")
            except Exception as e:  # noqa: BLE001
                print(f"  {str(cfg):22s} failed: {str(e)[:80]}")
