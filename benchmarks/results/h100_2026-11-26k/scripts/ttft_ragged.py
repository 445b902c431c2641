"""Lone requests (a lightly loaded server): prefill + 1 token of 40 prompts of 20-600 tokens, llama-1b compiled
engine, ragged graphs on and off alternately in one process; the second pass is measured (every bucket seen)."""
import random
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model  # noqa: E402

import hf_paged  # noqa: E402

model = build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
rng = random.Random(0)
prompts = [[rng.randrange(100, 30000) for _ in range(rng.randrange(20, 600))] for _ in range(40)]
times = {True: [], False: []}
for rep in range(3):
    for prompt in prompts:
        for on in (True, False):
            engine.runner.ragged_graphs = on
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.generate([prompt], max_new_tokens=1, ignore_eos=True)
            if rep == 2:
                times[on].append(time.perf_counter() - t)
for on, values in times.items():
    values = sorted(values)
    print(f"ragged_graphs={on}: lone prefill + 1 token, mean {1e3 * sum(values) / len(values):.2f} ms, "
          f"median {1e3 * values[len(values) // 2]:.2f} ms over {len(values)} prompts")
r = engine.runner
print("ragged graph steps", r.ragged_graph_steps, "recorded", sorted(k[1] for k in r._graphs if isinstance(k, tuple)),
      "failure", r.ragged_graph_failure)
