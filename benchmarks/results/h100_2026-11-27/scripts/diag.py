"""Why does the 4,096-token bucket's recording fail at warm-up? Print the failure; then a lazy engine fed a
~4,000-token ragged step three times (is that bucket recordable while serving?)."""
import sys
import traceback

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.runner import ragged_graphs

model = build_model("llama-1b", "cuda", torch.bfloat16)
orig = ragged_graphs.RaggedGraphs._give_up_ragged
def noisy(self, error):
    print("GIVE UP:", type(error).__name__, str(error)[:2000]); traceback.print_exception(error, limit=30)
    print("mem", torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30,
          torch.cuda.mem_get_info()[0] / 2**30)
    return orig(self, error)
ragged_graphs.RaggedGraphs._give_up_ragged = noisy
mode = sys.argv[1]
engine = hf_paged.Engine(model, compile_decode=True, max_num_batched_tokens=8192)
print("blocks", engine.kv_stats().total_blocks if hasattr(engine.kv_stats(), "total_blocks") else engine.kv_stats())
if mode == "pre":
    engine.warm_up(prefill_graphs=True)
    print(engine.warm_up_seconds, engine.runner.ragged_graph_failure)
else:
    engine.warm_up()
    for n in (4000, 4000, 4000, 3000, 3000):
        engine.generate([[5 + i % 300 for i in range(n)]], max_new_tokens=2, ignore_eos=True)
        print(n, engine.runner.ragged_graph_steps, engine.runner.ragged_graph_replays,
              sorted(engine.runner.ragged_capture_seconds), engine.runner.ragged_graph_failure, flush=True)
