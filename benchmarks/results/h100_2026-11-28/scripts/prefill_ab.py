"""Qwen3-0.6B shape, compiled engine: each prefill step of 256 uniform prompts timed (host wall of execute after a sync,
GPU time between events), three rounds of fresh prompts; then one round under the torch profiler, the prefill
steps' CUDA time by kernel. For whichever hf_paged is on the path. argv: out-prefix."""
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_generate import build_model, make_workload

import hf_paged

tag = sys.argv[1]
model = build_model("qwen3-0.6b", "cuda", torch.bfloat16)
engine = hf_paged.Engine(model, compile_decode=True)
engine.warm_up()
runner = engine.runner
exec_fn = runner.execute
log = []


def execute(sched, *args, **kwargs):
    if sched.decode_step or all(i.num_tokens == 1 for i in sched.scheduled):
        return exec_fn(sched, *args, **kwargs)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    s.record()
    out = exec_fn(sched, *args, **kwargs)
    host = time.perf_counter() - t
    e.record()
    torch.cuda.synchronize()
    log.append((sum(i.num_tokens for i in sched.scheduled), len(sched.scheduled), host * 1e3, s.elapsed_time(e)))
    return out


runner.execute = execute


def run(seed: int):
    for prompt, _n in make_workload("uniform", 256, seed):
        engine.add_request(prompt, max_new_tokens=2, ignore_eos=True)
    log.clear()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t
    big = log
    print(f"{tag} round {seed}: wall {wall*1e3:.0f} ms; prefill steps {len(big)}: host "
          f"{sum(x[2] for x in big):.1f} ms, GPU {sum(x[3] for x in big):.1f} ms; per step (tokens, host, GPU): "
          + " ".join(f"({x[0]},{x[2]:.1f},{x[3]:.1f})" for x in big[:4]))


for seed in (1, 2, 3):
    run(seed)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
    run(4)
rows = sorted(tp.key_averages(), key=lambda e: -e.device_time_total)[:14]
print(f"{tag} kernels (round 4, all steps): " + "; ".join(f"{r.key[:60]} {r.device_time_total/1e3:.1f} ms x{r.count}"
                                                         for r in rows))
engine.close()
