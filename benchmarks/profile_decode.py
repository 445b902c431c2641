"""Where a decode step's time goes: the torch profiler over steady engine steps, at one or more running counts; or,
with `--prefill`, where the first steps (the prefills) go.

Builds a named shape (`bench_generate.SHAPES`, random init), fills an engine with a workload (EOS ignored), steps until
the prefills are done, then, for each count of `--until-running` (0: at once), steps on until at most that many
sequences run and profiles `--steps` steps. For each window it prints

* the device kernels (CUDA kernels, memcpy and memset; on the CPU, the top-level CPU ops) by total time per step, with
  their launches per step and mean duration,
* the device time per step (the kernels' summed durations: the GPU's busy time), their span per step (first start to
  last end), the host wall time per step and the profiled CPU time per step,

With `--prefill` the window is the first `--steps` steps after the requests arrive (prefill chunks, and decodes once
some prompts are done): the same lists, each step's wall time and scheduled prompt tokens, and the host ops by their
own CPU time (a prefill step that is slow on the host shows there). `--no-prefix-caching` runs without the prefix
cache, for workloads that share a prompt (`shared_system`).

It writes, under `--out` (a prefill window without its Chrome trace), `<name>_at<running>.txt` (the profiler's table by device time), `.json` (a Chrome trace) and
`_kernels.json` (every kernel in launch order: name, start and duration in us): the kernel-by-kernel listing of a step
that the write-ups in benchmarks/results/ read (h100_2026-11-26h call b, h100_2026-11-27f call a, h200_2026-11-28
calls 1 and 4). The profiler stretches kernels shorter than a few us; time them in CUDA graphs for those.

    python benchmarks/profile_decode.py --model llama-1b --compile-decode --finished-only --until-running 240,64,8 \
        --steps 3                                                  # the compiled step's kernels at three batch sizes
    python benchmarks/profile_decode.py --model qwen3-0.6b --workload uniform --temperature 0.6 --top-p 0.95
    python benchmarks/profile_decode.py --model tiny --device cpu --num-requests 16 --until-running 12,4 --steps 2
    python benchmarks/profile_decode.py --model qwen3.5-9b --workload shared_system --num-requests 200 --prefill \
        --steps 4                                        # a hybrid's prefill steps of many short prompts
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_generate import (
    SHAPES,
    SHARED_SYSTEM,
    UNIFORM_WORKLOADS,
    WORKLOADS,
    build_model,
    make_workload,
    sampling_kwargs,
    sync,
)

import hf_paged

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def counts(text: str) -> list[int]:
    """`--until-running`: comma-separated running counts, each >= 0, profiled in the order given."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--workload", default="sharegpt", choices=sorted(WORKLOADS) + sorted(UNIFORM_WORKLOADS) + sorted(SHARED_SYSTEM))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--compile-decode", action="store_true")
    parser.add_argument("--steps", type=int, default=30, help="steps profiled in each window")
    parser.add_argument("--finished-only", action="store_true", help="step(finished_only=True), as generate() does")
    parser.add_argument("--prefill", action="store_true",
                        help="profile the first --steps steps (the prefills) instead of steady decode windows")
    parser.add_argument("--no-prefix-caching", action="store_true", help="run the engine without the prefix cache")
    parser.add_argument("--one-table", action="store_true",
                        help="one block table for every layer (release_window_blocks=False: no block groups)")
    parser.add_argument("--until-running", type=counts, default=[0],
                        help="comma list: before each window, step on until at most this many sequences run "
                             "(0: profile at once, after the prefills)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--kv-cache-memory", default=None, help="KV pool size (default: the engine's sizing)")
    parser.add_argument("--out", default="benchmarks/results")
    return parser


def device_rows(prof: torch.profiler.profile, device: str) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of the window's device work in launch order: CUDA kernels and copies on CUDA,
    the top-level CPU ops (those no other op called) on the CPU."""
    if device.startswith("cuda"):
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None]
    rows = [(e.name, float(e.time_range.start), float(e.time_range.elapsed_us())) for e in events]
    return sorted(rows, key=lambda r: r[1])


def kernel_table(rows: list[tuple[str, float, float]], steps: int) -> list[tuple[str, float, float, float]]:
    """(name, us per step, launches per step, mean us) per kernel name, the largest total first."""
    total: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for name, _, dur in rows:
        total[name] += dur
        launches[name] += 1
    return [(name, total[name] / steps, launches[name] / steps, total[name] / launches[name])
            for name in sorted(total, key=lambda n: (-total[n], n))]


def profile_window(engine, step, args, stem: str, out: Path) -> None:
    """Profile `args.steps` calls of `step`, write the table, trace and kernel list under `out`, print the summary."""
    cuda = args.device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync(args.device)
    step_ms, step_prompt = [], []
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            before, t0 = engine.stats["prefill_tokens"], time.perf_counter()
            step()
            sync(args.device)
            step_ms.append((time.perf_counter() - t0) * 1000)
            step_prompt.append(engine.stats["prefill_tokens"] - before)
            if args.prefill:  # as it goes: a slow window still says something when a time limit cuts it
                print(f"   step {len(step_ms)}: {step_ms[-1]:.1f} ms, {step_prompt[-1]} prompt tokens", flush=True)
        wall_ms = (time.perf_counter() - start) / args.steps * 1000
    rows = device_rows(prof, args.device)
    events = prof.key_averages()
    table = events.table(sort_by="device_time_total" if cuda else "self_cpu_time_total", row_limit=30)
    (out / f"{stem}.txt").write_text(table)
    if not args.prefill:  # (a prefill window's trace runs to gigabytes when its steps compile: not written)
        prof.export_chrome_trace(str(out / f"{stem}.json"))
    (out / f"{stem}_kernels.json").write_text(json.dumps(
        {"model": args.model, "window": stem, "steps": args.steps, "device": args.device,
         "step_ms": step_ms, "step_prompt_tokens": step_prompt,
         "kernels": [{"name": n, "start_us": s, "dur_us": d} for n, s, d in rows]}))
    busy = sum(d for _, _, d in rows) / args.steps
    span = (rows[-1][1] + rows[-1][2] - rows[0][1]) / args.steps if rows else 0.0
    cpu_ms = sum(e.self_cpu_time_total for e in events) / 1000 / args.steps
    print(f"== {stem}: {len(rows) / args.steps:.0f} device ops a step, busy {busy:.0f} us, span {span:.0f} us; "
          f"wall {wall_ms:.2f} ms, profiled CPU time {cpu_ms:.2f} ms a step; "
          f"pipelined steps so far {engine.pipelined_steps}")
    print("   steps (wall ms / prompt tokens): " + ", ".join(f"{ms:.1f}/{n}" for ms, n in zip(step_ms, step_prompt)))
    for kernel, per_step, launches, mean in kernel_table(rows, args.steps)[:25]:
        print(f"  {per_step:9.1f} us/step {launches:6.1f} x {mean:8.2f} us  {kernel[:100]}")
    if args.prefill:
        print("   host ops by own CPU time:")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]:
            print(f"  {e.self_cpu_time_total / 1000 / args.steps:9.2f} ms/step {e.count / args.steps:8.1f} calls  "
                  f"{e.key[:100]}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    dtype = _DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    workload = make_workload(args.workload, args.num_requests, 0)
    start = time.perf_counter()
    model = build_model(args.model, args.device, dtype)
    built = time.perf_counter()
    engine = hf_paged.Engine(model, compile_decode=args.compile_decode, kv_cache_memory=args.kv_cache_memory,
                             enable_prefix_caching=not args.no_prefix_caching,
                             release_window_blocks=not args.one_table)
    engine.warm_up()
    print(f"model built in {built - start:.1f} s, engine made and warmed up in {time.perf_counter() - built:.1f} s",
          flush=True)
    for prompt, n in workload:
        engine.add_request(prompt, max_new_tokens=n, ignore_eos=True, **sampling_kwargs(args))
    step = lambda: engine.step(finished_only=args.finished_only)
    name = f"profile_{args.model}_{args.workload}" + (f"_t{args.temperature:g}" if args.temperature else "") + (
        "_compiled" if args.compile_decode else "") + ("_onetable" if args.one_table else "")
    if args.prefill:
        profile_window(engine, step, args, f"{name}_prefill", out)
        engine.close()
        return
    while engine.scheduler.waiting or any(s.is_prefill for g in engine.scheduler.running for s in g.live_seqs()):
        step()
    for _ in range(5):
        step()
    for until in args.until_running:
        while until and engine.has_unfinished() and engine.scheduler.num_running_seqs() > until:
            step()
        if not engine.has_unfinished():
            print(f"the workload finished before {until} sequences ran: no window")
            break
        profile_window(engine, step, args, f"{name}_at{engine.scheduler.num_running_seqs()}", out)
    engine.close()


if __name__ == "__main__":
    main()
