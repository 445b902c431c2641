"""A bucket's first, second and third step, timed: lone llama-1b prompts (prefill + 1 token), 14 distinct buckets of
20-1,500 tokens (each length its own bucket), each prompt run three times in turn, prefix caching off. The library is
whichever `hf_paged` PYTHONPATH gives (old: recorded right after the second run; new: in place of it)."""
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.runner.ragged_graphs import graph_tokens  # noqa: E402

model = build_model("llama-1b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True, enable_prefix_caching=False)
engine.warm_up()
lengths, seen = [], set()
for n in range(20, 1500, 97):
    if graph_tokens(n) not in seen:
        seen.add(graph_tokens(n))
        lengths.append(n)
prompts = [[100 + (7 * i + n) % 29000 for i in range(n)] for n in lengths]
engine.generate([prompts[0][:5]], max_new_tokens=1)  # one ragged step of another bucket first (the warm-up)
times = [[], [], []]
for occurrence in range(3):
    for prompt in prompts:
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate([prompt], max_new_tokens=1, ignore_eos=True)
        times[occurrence].append(1e3 * (time.perf_counter() - t))
for k, values in enumerate(times):
    print(f"occurrence {k + 1}: mean {sum(values) / len(values):.2f} ms, max {max(values):.2f} ms over {len(values)} "
          f"buckets: {' '.join(f'{v:.1f}' for v in values)}")
r = engine.runner
print("ragged steps", r.ragged_graph_steps, "recorded", len([k for k in r._graphs if isinstance(k, tuple)]),
      "capture s", round(sum(r.ragged_capture_seconds.values()), 3), "failure", r.ragged_graph_failure)
