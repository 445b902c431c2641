"""Host time of mixed steps (cProfile, no CUDA profiler): llama-1b compiled engine, Alpaca-like 1000 requests."""
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

model = build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.runner.compile_prefill = os.environ.get("PREFILL", "1") == "1"
engine.warm_up()
for prompt, n in make_workload("alpaca", 1000, 0):
    engine.add_request(prompt, max_new_tokens=n, ignore_eos=True)
for _ in range(8):
    engine.step()
torch.cuda.synchronize()
t = time.perf_counter()
prof = cProfile.Profile()
prof.enable()
for _ in range(60):
    engine.step()
torch.cuda.synchronize()
prof.disable()
print(f"60 steps {time.perf_counter() - t:.3f} s (cProfile on)")
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
print(s.getvalue()[:14000])
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
print(s.getvalue()[:9000])
