"""A fresh server's first pass under steady arrivals (in-process, no HTTP), with the prefill graphs recorded at
warm-up (argv[1] = pre) or lazily while serving (lazy): llama-1b compiled engine, prompts of 20-400, outputs of 32-256
tokens, Poisson arrivals at argv[2]/s, argv[3] requests; two passes of the same arrivals. Prints warm-up time, TTFT
and TPOT per pass, ragged steps, replays and recordings made while serving."""
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model  # noqa: E402

import hf_paged  # noqa: E402

MODE, RATE, N = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
model = build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True, max_num_batched_tokens=8192)
GiB = 2**30


def pools() -> str:
    """GiB reserved in the general pool and in private pools (CUDA graphs), from the allocator's segments."""
    general = private = 0
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0):
            general += seg["total_size"]
        else:
            private += seg["total_size"]
    return f"general {general / GiB:.2f} private {private / GiB:.2f} GiB"


print("library", hf_paged.__file__, flush=True)
engine.warm_up()
r_before = torch.cuda.memory_reserved() / GiB
t0 = time.perf_counter()
if MODE == "pre":
    engine.runner.record_ragged_buckets()
torch.cuda.synchronize()
print(f"{MODE}: prefill graphs {time.perf_counter() - t0:.2f} s, {len(engine.runner.ragged_capture_seconds)} buckets;"
      f" reserved {r_before:.2f} -> {torch.cuda.memory_reserved() / GiB:.2f} GiB ({pools()});",
      engine.runner.ragged_graph_failure,
      flush=True)
rng = random.Random(1)
reqs, t = [], 0.0
for _ in range(N):
    t += rng.expovariate(RATE)
    reqs.append((t, [rng.randrange(100, 30000) for _ in range(rng.randrange(20, 400))], rng.randrange(32, 256)))


def serve(label):
    r = engine.runner
    r0, p0, c0 = r.ragged_graph_steps, r.ragged_graph_replays, len(r.ragged_capture_seconds)
    start = time.perf_counter()
    pending = list(reqs)
    arrive, first, done = {}, {}, {}
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, prompt, n = pending.pop(0)
            rid = engine.add_request(prompt, max_new_tokens=n, ignore_eos=True)
            arrive[rid] = start + at
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for out in engine.step():
            rid = out.request_id
            if rid not in first and out.outputs[0].token_ids:
                first[rid] = time.perf_counter()
            if out.finished:
                done[rid] = (time.perf_counter(), len(out.outputs[0].token_ids))
    wall = time.perf_counter() - start
    ttft = np.array([first[k] - arrive[k] for k in arrive]) * 1e3
    first50 = np.array([first[k] - arrive[k] for k in list(arrive)[:50]]) * 1e3
    tpot = np.array([(done[k][0] - first[k]) / max(1, done[k][1] - 1) for k in arrive]) * 1e3
    print(f"{MODE} {label} rate {RATE}/s: wall {wall:.2f} s; TTFT mean {ttft.mean():.1f} p50 {np.median(ttft):.1f} "
          f"p99 {np.percentile(ttft, 99):.1f} ms (first 50 requests: mean {first50.mean():.1f} max {first50.max():.1f});"
          f" TPOT mean {tpot.mean():.2f} p50 {np.median(tpot):.2f} p99 {np.percentile(tpot, 99):.2f} ms; ragged "
          f"steps {r.ragged_graph_steps - r0}, replayed {r.ragged_graph_replays - p0}, recorded while serving "
          f"{len(r.ragged_capture_seconds) - c0}", flush=True)


serve("pass1")
serve("pass2")
print(f"{MODE}: reserved after serving {torch.cuda.memory_reserved() / GiB:.2f} GiB ({pools()}); recorded",
      sorted(engine.runner.ragged_capture_seconds), "dummy", sorted(getattr(engine.runner, "ragged_dummy_recorded", ())),
      engine.runner.ragged_graph_failure, flush=True)
