"""A server's ragged buckets recorded lazily in ascending order (one prompt per bucket, each recorded at its first
run), with the largest bucket recorded first (FIRST=1, the library) or not (FIRST=0: `_record_dummy` stood in for
by a no-op, prompts below the largest bucket): the graph pool's size after."""
import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model  # noqa: E402

import hf_paged  # noqa: E402

GiB = 2**30
model = build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True, max_num_batched_tokens=8192, enable_prefix_caching=False)
engine.warm_up()
runner = engine.runner
runner.ragged_capture_after = 0
if os.environ.get("FIRST", "1") == "0":
    runner._record_dummy = lambda bucket: True


def pool() -> float:
    p = tuple(runner._pool)
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == p) / GiB


before = pool()
t = time.perf_counter()
g = torch.Generator().manual_seed(0)
for n in list(range(20, 256, 16)) + list(range(260, 3800, 120)):
    engine.generate([torch.randint(100, 30000, (n,), generator=g).tolist()], max_new_tokens=1, ignore_eos=True)
print(f"FIRST={os.environ.get('FIRST', '1')}: pool {before:.2f} -> {pool():.2f} GiB; recorded "
      f"{len(runner.ragged_capture_seconds)} buckets in {time.perf_counter() - t:.1f} s, dummy "
      f"{sorted(runner.ragged_dummy_recorded)}, failure {runner.ragged_graph_failure}", flush=True)
