"""Where a decode step's time goes: torch profiler over a window of steady-state engine steps.

Builds a named shape (bf16, random init), fills the engine with a workload, steps until the prefills are done, then
profiles `--steps` steps and prints the kernels by total CUDA time, the CUDA time per step and the host (CPU) time
per step. Writes the table and a Chrome trace to `--out`.

    python benchmarks/profile_decode.py --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from bench_generate import SHAPES, UNIFORM_WORKLOADS, WORKLOADS, build_model, make_workload, sampling_kwargs

import hf_paged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--workload", default="sharegpt", choices=sorted(WORKLOADS) + sorted(UNIFORM_WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--compile-decode", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--finished-only", action="store_true", help="step(finished_only=True), as generate() does")
    parser.add_argument("--until-running", type=int, default=0,
                        help="step on until at most this many sequences run before profiling (a workload's tail)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = make_workload(args.workload, args.num_requests, 0)
    model = build_model(args.model, "cuda", torch.bfloat16)
    engine = hf_paged.Engine(model, compile_decode=args.compile_decode)
    engine.warm_up()
    for prompt, n in workload:
        engine.add_request(prompt, max_new_tokens=n, ignore_eos=True, **sampling_kwargs(args))
    while engine.scheduler.waiting or any(s.is_prefill for g in engine.scheduler.running for s in g.live_seqs()):
        engine.step(finished_only=args.finished_only)
    for _ in range(5):
        engine.step(finished_only=args.finished_only)
    while args.until_running and engine.scheduler.num_running_seqs() > args.until_running:
        engine.step(finished_only=args.finished_only)
    torch.cuda.synchronize()
    running = engine.scheduler.num_running_seqs()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step(finished_only=args.finished_only)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.steps
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / 1000 / args.steps
    cpu_total = sum(e.self_cpu_time_total for e in events) / 1000 / args.steps
    name = f"profile_{args.model}_{args.workload}" + (f"_t{args.temperature:g}" if args.temperature else "") + (
        "_compiled" if args.compile_decode else "") + (f"_upto{args.until_running}" if args.until_running else "")
    (out / f"{name}.txt").write_text(table)
    prof.export_chrome_trace(str(out / f"{name}.json"))
    print(table)
    print(f"running sequences: {running}; wall per step {wall * 1000:.2f} ms; CUDA time per step {cuda_total:.2f} ms; "
          f"profiled CPU time per step {cpu_total:.2f} ms; pipelined steps {engine.pipelined_steps}")
    engine.close()


if __name__ == "__main__":
    main()
