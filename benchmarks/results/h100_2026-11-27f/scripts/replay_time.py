"""Host and GPU time of each decode bucket's graph replay (llama-1b, compiled), and its node count."""
import json
import sys
import time

sys.path.insert(0, "benchmarks")
import bench_generate
import torch

import hf_paged

model = bench_generate.build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, max_num_seqs=256, kv_cache_memory="8GiB", compile_decode=True)
engine.warm_up()
r = engine.runner
out = {}
for b in sorted(r._graphs):
    run = r._graphs[b]
    if run is None or not isinstance(b, int):
        continue
    g = run.__defaults__[0]
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    host = []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(60):
        t = time.perf_counter(); run(); host.append(time.perf_counter() - t)
    e.record(); torch.cuda.synchronize()
    host.sort()
    out[b] = (round(s.elapsed_time(e) / 60 * 1000, 1), round(host[30] * 1e6, 1))
print("retries", getattr(r, "capture_retries", None), json.dumps(out))
