"""Decode-step graph replay time per batch bucket, llama-1b compiled, 256 rows of ~300-token contexts in the buffers."""
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(1, os.path.join(os.getcwd(), "benchmarks"))
from bench_generate import build_model  # noqa: E402

import hf_paged  # noqa: E402

model = build_model(sys.argv[1] if len(sys.argv) > 1 else "llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, max_num_seqs=256, compile_decode=True)
engine.warm_up()
g = torch.Generator().manual_seed(0)
for _ in range(256):
    engine.add_request(torch.randint(10, 1000, (280,), generator=g).tolist(), max_new_tokens=400, ignore_eos=True)
while engine.stats["decode_tokens"] < 256 * 20:
    engine.step(finished_only=True)
torch.cuda.synchronize()
runner = engine.runner
t0 = time.perf_counter()
extra = [b for b in range(8, 257, 8) if b not in runner._graphs]
with torch.inference_mode():
    for b in extra:
        runner._graphs[b] = runner._capture(b)
for _ in range(3):  # real rows back in the buffers (the captures left dummy ones)
    engine.step(finished_only=True)
torch.cuda.synchronize()
print(f"captured {len(extra)} extra buckets in {time.perf_counter() - t0:.1f} s", flush=True)
res = {}
for _rep in range(2):
    for b in sorted(runner._graphs):
        run = runner._graphs[b]
        if run is None:
            continue
        with torch.inference_mode():
            for _ in range(3):
                run()
        torch.cuda.synchronize()
        ts = []
        for _ in range(15):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) * 1000)
        ts.sort()
        res.setdefault(b, []).append(ts[len(ts) // 2])
default = runner._bucket_sizes
print("| bucket | us (two passes) | in default buckets |")
for b in sorted(res):
    print(f"| {b} | {res[b][0]:.0f} / {res[b][1]:.0f} | {'yes' if b in default else ''} |")
