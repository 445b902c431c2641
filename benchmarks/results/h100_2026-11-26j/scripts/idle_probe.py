"""GPU idle between pipelined decode steps, without a profiler (CUDA events), and the same with every bucket's
graph recorded twice and the two replayed in turn (DOUBLE=1). Scratch."""
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402

MODEL = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
VARIANTS = (sys.argv[2] if len(sys.argv) > 2 else "single,double,single,double").split(",")
model = build_model(MODEL, "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, block_size=16, max_num_seqs=256, gpu_memory_utilization=0.9, compile_decode=True)
engine.warm_up()
runner = engine.runner
singles = dict(runner._graphs)
t = time.perf_counter()
doubles = {}
with torch.inference_mode():
    for bucket, first in singles.items():
        if first is None:
            continue
        second = runner._capture(bucket)
        state = {"n": 0}

        def alternate(first=first, second=second, state=state):
            state["n"] += 1
            return (first if state["n"] % 2 else second)()

        doubles[bucket] = alternate
torch.cuda.synchronize()
print(f"second captures: {time.perf_counter() - t:.2f} s for {len(doubles)} buckets", flush=True)

marks = []  # ("S" | "F", event, host time)
exec_fn, launch_fn, sample_fn = runner.execute, engine._launch, engine._sample_and_update
host = {"after_sample": None, "mixed_gap": 0.0, "mixed_steps": 0}


def execute(sched, *a, **k):
    if host["after_sample"] is not None:
        host["mixed_gap"] += time.perf_counter() - host["after_sample"]
        host["after_sample"] = None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    marks.append(("S", ev))
    return exec_fn(sched, *a, **k)


def launch(sched, logits):
    out = launch_fn(sched, logits)
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    marks.append(("F", ev))
    return out


def sample(sched, logits):
    out = sample_fn(sched, logits)
    host["after_sample"] = time.perf_counter()
    host["mixed_steps"] += 1
    return out


runner.execute, engine._launch, engine._sample_and_update = execute, launch, sample
for i, variant in enumerate(VARIANTS):
    runner._graphs.clear()
    runner._graphs.update(doubles if variant == "double" else singles)
    marks.clear()
    host.update(after_sample=None, mixed_gap=0.0, mixed_steps=0)
    for p, n in make_workload("sharegpt", 256, 10 + i):
        engine.add_request(p, max_new_tokens=n, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    idle, pairs, big = 0.0, 0, 0
    for (k1, e1), (k2, e2) in zip(marks, marks[1:]):
        if k1 == "F" and k2 == "S":
            ms = e1.elapsed_time(e2)
            idle += ms
            pairs += 1
            big += ms > 0.1
    print(f"{variant}: wall {wall:.3f} s; pipelined transitions {pairs}, GPU idle between them {idle:.1f} ms "
          f"({big} over 100 us); non-pipelined steps {host['mixed_steps']}, host time from their sync to the next "
          f"step {host['mixed_gap'] * 1e3:.1f} ms", flush=True)
