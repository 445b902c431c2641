"""Time to first token of lone requests (a lightly loaded server): llama-1b compiled engine, 40 prompts of 20-600
tokens one at a time, padding of ragged steps on and off alternately in one process."""
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
for rep in range(2):  # the second pass is measured: every padded count (and every other count) was seen once
    for prompt in prompts:
        for pad in (True, False):
            engine.runner.pad_ragged = pad
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.generate([prompt], max_new_tokens=1, ignore_eos=True)
            if rep:
                times[pad].append(time.perf_counter() - t)
for pad, values in times.items():
    values = sorted(values)
    print(f"pad={pad}: lone prefill + 1 token, mean {1e3 * sum(values) / len(values):.2f} ms, "
          f"median {1e3 * values[len(values) // 2]:.2f} ms over {len(values)} prompts")
