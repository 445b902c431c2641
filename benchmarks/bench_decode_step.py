"""GPU time of one decode step per batch bucket: CUDA graph of the eager forward vs of the compiled forward.

A decode step of a small model is bound by how many kernels it runs, not by its bytes: this script shows it. For
each engine variant (`graph`: transformers' modeling code run eagerly inside a CUDA graph; `compiled`:
`compile_decode=True`, the same code traced by Dynamo and fused by Inductor around hf_paged's attention op, then
captured), it builds the engine, warms it up (capture of every bucket), points every row of a bucket at a context of
`--context` tokens and times graph replays with CUDA events. It also profiles one un-captured forward per variant to
count the kernels of a step and their summed GPU time, and gives the lower bound set by the bytes a step must read
(weights once, plus every row's KV) at the HBM copy rate of the project's anchors (3.02 TB/s).

Prints a markdown table, writes JSON and a PNG plot (step time vs batch size).

    python benchmarks/bench_decode_step.py --model llama-1b --batches 1,16,64,128,256
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_generate import build_model  # noqa: E402
from roofline import decode_bound_s, expert_weights, kv_read_groups, model_bytes  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.cache import kv_bytes_per_token  # noqa: E402

HBM_TBPS = 3.02  # ../shared/anchors.md: HBM copy rate measured on the device


def kernels_of_one_step(runner, batch: int) -> tuple[int, float]:
    """(kernels launched, their summed GPU time in ms) for one un-captured decode forward of `batch` rows."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        runner._run_model(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner._run_model(batch)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    total_us = sum(e.device_time if hasattr(e, "device_time") else e.cuda_time for e in kernels)
    return len(kernels), total_us / 1000


def time_variant(model, compiled: bool, batches: list[int], context: int, args) -> dict:
    start = time.perf_counter()
    engine = hf_paged.Engine(model, block_size=16, max_num_seqs=max(batches), kv_cache_memory=args.kv_cache_memory,
                             max_num_batched_tokens=args.max_num_batched_tokens, compile_decode=compiled)
    engine.warm_up()
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - start
    runner = engine.runner
    b = runner._buffers
    blocks = -(-context // 16)
    if blocks > engine.block_manager.num_blocks:
        raise SystemExit(f"--context {context} needs {blocks} blocks, the pool has {engine.block_manager.num_blocks}")
    # every row reads the same `context` tokens (real bytes, no writes: slot -1); row 0 of the table store is theirs
    b["store"][0, :blocks] = torch.arange(blocks, dtype=torch.int32, device=b["store"].device)
    rows = []
    for batch in batches:
        bucket = next(s for s in runner._bucket_sizes if s >= batch)
        run = runner._graphs[bucket]
        b["slots"].fill_(-1)
        b["rows"].zero_()
        b["lens"].zero_()
        b["lens"][:batch] = context
        b["ids"].random_(100, 30000)
        b["pos"].fill_(context - 1)
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(args.iters):
            run()
        end.record()
        torch.cuda.synchronize()
        step_ms = begin.elapsed_time(end) / args.iters
        count, kernel_ms = kernels_of_one_step(runner, bucket)
        rows.append({"batch": batch, "bucket": bucket, "step_ms": step_ms, "kernels": count,
                     "kernel_sum_ms": kernel_ms})
    engine.close()
    hf_paged.disable(model)
    return {"setup_s": setup_s, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batches", default="1,8,32,64,128,192,256")
    parser.add_argument("--context", type=int, default=512, help="tokens every row attends to")
    parser.add_argument("--variants", default="graph,compiled")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--kv-cache-memory", default="8GiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="benchmarks/results")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_step.py times CUDA graphs: it needs a GPU")
    model = build_model(args.model, "cuda", getattr(torch, args.dtype))
    batches = [int(x) for x in args.batches.split(",")]
    weight_bytes = model_bytes(model)  # what a step reads: not the rows-only input embedding of an untied model
    kv_token = kv_bytes_per_token(model.config, model.dtype)
    import transformers

    meta = {"model": args.model, "context": args.context, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "dtype": args.dtype, "command": " ".join(sys.argv),
            "weight_gib": weight_bytes / 2**30}
    results = {}
    for variant in args.variants.split(","):
        results[variant] = time_variant(model, variant == "compiled", batches, args.context, args)
        print(f"{variant}: start-up {results[variant]['setup_s']:.1f} s", flush=True)
    print(f"\n{meta}\n")
    names = list(results)
    header = " | ".join(f"{n} ms (kernels, kernel-sum ms)" for n in names)
    print(f"| batch | {header} | bytes bound ms | " + " | ".join(f"{n} tok/s" for n in names) + " |")
    print("|---" * (3 + 2 * len(names)) + "|")
    table = []
    for i, batch in enumerate(batches):
        step = [([0] * args.context, 1)] * batch  # one step of `batch` rows at `context` keys each
        bound_ms = decode_bound_s(step, weight_bytes, kv_read_groups(model.config, kv_token), HBM_TBPS * 1e12,
                                  experts=expert_weights(model)) * 1e3
        cells = [results[n]["rows"][i] for n in names]
        row = {"batch": batch, "bound_ms": bound_ms, **{n: c for n, c in zip(names, cells)}}
        table.append(row)
        print(f"| {batch} | " + " | ".join(f"{c['step_ms']:.2f} ({c['kernels']}, {c['kernel_sum_ms']:.2f})"
                                           for c in cells)
              + f" | {bound_ms:.2f} | " + " | ".join(f"{batch / c['step_ms'] * 1e3:,.0f}" for c in cells) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"decode_step_{args.model}_ctx{args.context}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "setup_s": {n: results[n]["setup_s"] for n in names},
                                                   "rows": table}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name in names:
        ax.plot(batches, [r[name]["step_ms"] for r in table], "o-", label=name)
    ax.plot(batches, [r["bound_ms"] for r in table], "k--", label="bytes / 3.02 TB/s")
    ax.set_xlabel("sequences in the step")
    ax.set_ylabel("GPU ms per decode step")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title(f"{args.model}, context {args.context}, {meta['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
