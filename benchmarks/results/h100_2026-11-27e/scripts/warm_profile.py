"""Warm start-up, split: the compiler's first imports vs the engine's own work (profiled)."""
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, "benchmarks")
import bench_generate
import torch

import hf_paged

print("flags: dont_write_bytecode", sys.flags.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix,
      "PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"), flush=True)
model = bench_generate.build_model("llama-1b", "cuda", torch.bfloat16)
torch.cuda.synchronize()
t0 = time.perf_counter()
if os.environ.get("PREIMPORT"):
    import torch._dynamo  # noqa
    import torch._inductor.compile_fx  # noqa
    import torch._functorch.aot_autograd  # noqa
t1 = time.perf_counter()
prof = cProfile.Profile() if os.environ.get("PROFILE") else None
if prof:
    prof.enable()
engine = hf_paged.Engine(model, max_num_seqs=256, kv_cache_memory="8GiB", compile_decode=True)
engine.warm_up()
torch.cuda.synchronize()
t2 = time.perf_counter()
if prof:
    prof.disable()
from torch._dynamo.utils import compile_times, counters  # noqa: E402

print(compile_times(repr="str", aggregate=True))
print({k: dict(v) for k, v in counters.items() if k in ("frames", "stats", "recompiles", "graph_break")})
print(json.dumps({"preimport_s": t1 - t0, "engine_s": t2 - t1, "phases": dict(engine.warm_up_seconds)}), flush=True)
if prof:
    prof.dump_stats(os.environ.get("PROF_OUT", "/tmp/warm.prof"))
    s = io.StringIO()
    p = pstats.Stats(prof, stream=s)
    p.sort_stats("cumulative").print_stats(120)
    p.sort_stats("tottime").print_stats(50)
    print(s.getvalue())
engine.close()
