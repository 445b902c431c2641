"""cProfile of a warm compile_decode start-up (second process on the same caches)."""
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..")); sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch
from bench_generate import build_model

import hf_paged

model = build_model(sys.argv[1] if len(sys.argv) > 1 else "llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True, max_num_seqs=256, kv_cache_memory="8GiB")
pr = cProfile.Profile()
t = time.perf_counter()
if os.environ.get("PROFILE") == "1":
    pr.enable()
engine.warm_up()
pr.disable()
print("warm_up", round(time.perf_counter() - t, 2), engine.warm_up_seconds)
if os.environ.get("PROFILE") == "1":
    pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
