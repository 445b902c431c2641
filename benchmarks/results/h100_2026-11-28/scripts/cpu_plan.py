"""CPU: the host's planning of a 16,384-token prefill step (what the GPU waits for before each prefill step): time from
the step's start to `runner.execute`, and a cProfile of that part. 256 ShareGPT-like prompts, tiny 1-layer llama."""
import cProfile
import pstats
import sys
import time

sys.path.insert(0, "benchmarks")
from bench_generate import make_workload

import hf_paged
from hf_paged.testing import tiny_model

model = tiny_model("llama", seed=1, num_hidden_layers=1, max_position_embeddings=8192)
engine = hf_paged.Engine(model, block_size=16, max_num_seqs=256, max_num_batched_tokens=16384, num_blocks=8192,
                         use_cuda_graph=False)
engine.warm_up()
runner = engine.runner
exec_fn = runner.execute
marks = []
prof = cProfile.Profile()


def execute(sched, *args, **kwargs):
    prof.disable()
    marks.append((time.perf_counter(), sum(i.num_tokens for i in sched.scheduled)))
    return exec_fn(sched, *args, **kwargs)


runner.execute = execute
for rnd in range(3):
    for prompt, _n in make_workload("sharegpt", 256, rnd + 10):
        engine.add_request([t % 384 for t in prompt], max_new_tokens=2, ignore_eos=True)
    plans = []
    while engine.has_unfinished():
        marks.clear()
        t = time.perf_counter()
        if rnd == 2:
            prof.enable()
        engine.step()
        prof.disable()
        if marks and marks[0][1] > 300:
            plans.append((marks[0][1], (marks[0][0] - t) * 1e3))
    print("round", rnd, "planning ms of prefill steps (tokens, ms):", [(a, round(b, 2)) for a, b in plans])
st = pstats.Stats(prof)
st.sort_stats("tottime").print_stats(18)
