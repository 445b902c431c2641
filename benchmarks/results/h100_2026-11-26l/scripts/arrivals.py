"""(twelfth session: passes from argv[3], e.g. on,on) A server under steady arrivals (in-process, no HTTP): llama-1b compiled engine, requests with prompts of 20-400
and outputs of 32-256 tokens arriving as a Poisson process; ragged graphs on and off in turn in one process (each
pass a fresh copy of the same arrivals). Prints TTFT and TPOT per setting, the run time and the ragged steps."""
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model  # noqa: E402

import hf_paged  # noqa: E402

RATE = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
N = int(sys.argv[2]) if len(sys.argv) > 2 else 400
model = build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True, max_num_batched_tokens=8192)
engine.warm_up()
rng = random.Random(1)
reqs, t = [], 0.0
for _ in range(N):
    t += rng.expovariate(RATE)
    reqs.append((t, [rng.randrange(100, 30000) for _ in range(rng.randrange(20, 400))], rng.randrange(32, 256)))


def serve(on):
    engine.runner.ragged_graphs = on
    r0 = engine.runner.ragged_graph_steps
    e0 = engine.runner.eager_steps
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
    ttft = np.array([first[r] - arrive[r] for r in arrive]) * 1e3
    tpot = np.array([(done[r][0] - first[r]) / max(1, done[r][1] - 1) for r in arrive]) * 1e3
    print(f"rate {RATE}/s ragged_graphs={on}: wall {wall:.2f} s; TTFT mean {ttft.mean():.1f} p50 {np.median(ttft):.1f} "
          f"p99 {np.percentile(ttft, 99):.1f} ms; TPOT mean {tpot.mean():.2f} p50 {np.median(tpot):.2f} p99 "
          f"{np.percentile(tpot, 99):.2f} ms; ragged steps {engine.runner.eager_steps - e0} of which on the buffers "
          f"{engine.runner.ragged_graph_steps - r0}", flush=True)


PASSES = [p == "on" for p in (sys.argv[3].split(",") if len(sys.argv) > 3 else ["on", "on"])]
for on in PASSES:  # a fresh process: the first "on" pass records the buckets it meets
    serve(on)
r = engine.runner
print("recorded", sorted(k[1] for k in r._graphs if isinstance(k, tuple)), "capture s",
      round(sum(r.ragged_capture_seconds.values()), 3), "failure", r.ragged_graph_failure)
