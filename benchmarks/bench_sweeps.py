"""Sweeps from the PagedAttention paper's §7: kernel latency vs context length (Fig. 18a), end-to-end throughput vs
block size (Fig. 18b), and the running batch the engine sustains inside the KV memory DynamicCache would need for
fixed batches (Fig. 13's point: more sequences fit when memory is not reserved for the longest one).

    python benchmarks/bench_sweeps.py --out benchmarks/results        # needs a CUDA GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_splits import graph_time_us  # noqa: E402
from bench_generate import build_model, make_workload  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import kernels  # noqa: E402


def kernel_vs_context(block_sizes, lengths, batch=32, heads=(32, 8), head_dim=128):
    """Paged decode latency (µs) per context length and block size, against SDPA on a contiguous cache."""
    # Timing Python calls (triton's do_bench) measured the host, not the kernel, wherever the kernel takes less than
    # its dispatch and launch (~100-150 µs here: B=32 at contexts up to 2048 came out flat at 150-250 µs). In the
    # engine the kernel runs inside a CUDA graph, so it is timed in one here (`graph_time_us`). The inputs stay in L2
    # only when they fit (the shortest contexts); the reads of the longer ones are HBM reads.
    def do_bench(fn) -> float:  # ms, as the callers expect
        return graph_time_us(fn) / 1e3

    # the GPU idles at a low clock (345 MHz seen at the start of a call): keep it busy a second before timing
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < 1.5:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    hq, hkv = heads
    rows = []
    for length in lengths:
        q = torch.randn(batch, hq, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, hkv, length, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sdpa = do_bench(partial(torch.nn.functional.scaled_dot_product_attention, q[:, :, None], k, v,
                                enable_gqa=True))
        row = {"context": length, "sdpa_us": sdpa * 1e3}
        for bs in block_sizes:
            nblk = -(-length // bs)
            total = batch * nblk
            perm = torch.randperm(total, device="cuda")
            kc = torch.empty(total, hkv, bs, head_dim, device="cuda", dtype=torch.bfloat16)
            vc = torch.empty_like(kc)
            for src, dst in ((k, kc), (v, vc)):
                padded = torch.nn.functional.pad(src, (0, 0, 0, nblk * bs - length))
                blocks = padded.view(batch, hkv, nblk, bs, head_dim).permute(0, 2, 1, 3, 4)
                dst[perm] = blocks.reshape(total, hkv, bs, head_dim)
            tables = perm.view(batch, nblk).to(torch.int32)
            lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            call = partial(kernels.paged_decode, q, kc, vc, tables, lens, head_dim**-0.5)
            row[f"bs{bs}_us"] = do_bench(call) * 1e3
        rows.append(row)
    return rows


def block_size_sweep(model, workload, block_sizes):
    rows = []
    for bs in block_sizes:
        gc.collect()
        torch.cuda.empty_cache()
        engine = hf_paged.Engine(model, block_size=bs, max_num_seqs=256, max_num_batched_tokens=8192)
        engine.warm_up()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate([p for p, _ in workload],
                        [hf_paged.SamplingParams(max_new_tokens=o, ignore_eos=True) for _, o in workload])
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        rows.append({"block_size": bs, "wall_s": wall, "output_tok_s": sum(o for _, o in workload) / wall})
        model._hf_paged_engine = None
        del engine
        gc.collect()
    return rows


def batch_at_dynamic_budget(model, workload, dynamic_batch: int):
    """KV bytes of DynamicCache batches of `dynamic_batch` (padded to the longest prompt + output), given to the
    engine as its pool; report the engine's mean / max running batch inside it."""
    per_token = hf_paged.cache.kv_bytes_per_token(model.config, torch.bfloat16)
    budgets = []
    for i in range(0, len(workload), dynamic_batch):
        chunk = workload[i : i + dynamic_batch]
        longest = max(len(p) for p, _ in chunk) + max(o for _, o in chunk)
        budgets.append(len(chunk) * longest * per_token)
    budget = int(sum(budgets) / len(budgets))
    gc.collect()
    torch.cuda.empty_cache()
    engine = hf_paged.Engine(model, kv_cache_memory=budget, max_num_seqs=512, max_num_batched_tokens=8192)
    engine.generate([p for p, _ in workload],
                    [hf_paged.SamplingParams(max_new_tokens=o, ignore_eos=True) for _, o in workload])
    steps = max(1, engine.stats["steps"])
    result = {
        "kv_budget_gib": budget / 2**30, "dynamic_batch": dynamic_batch,
        "engine_mean_running": engine.stats["running_sum"] / steps, "engine_max_running": engine.stats["max_running"],
        "preemptions": sum(engine.scheduler.num_preemptions.values()),
    }
    model._hf_paged_engine = None
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--block-sizes", default="8,16,32,64,128")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--parts", default="kernel,blocks,budget")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    parts = set(args.parts.split(","))
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "kernel" in parts:
        result["kernel"] = kernel_vs_context(block_sizes, [256, 512, 1024, 2048, 4096, 8192])
        print("\nPaged decode latency (µs), B=32, 32/8 heads, d=128, bf16")
        print("| context | SDPA | " + " | ".join(f"bs {b}" for b in block_sizes) + " |")
        print("|---" * (2 + len(block_sizes)) + "|")
        for r in result["kernel"]:
            print(f"| {r['context']} | {r['sdpa_us']:.1f} | "
                  + " | ".join(f"{r[f'bs{b}_us']:.1f}" for b in block_sizes) + " |")
    workload = make_workload("sharegpt", args.num_requests, 0)
    if parts & {"blocks", "budget"}:
        model = build_model(args.model, "cuda", torch.bfloat16)
    if "blocks" in parts:
        result["blocks"] = block_size_sweep(model, workload, block_sizes)
        print(f"\nEnd to end vs block size ({args.model}, {len(workload)} ShareGPT-like requests)")
        print("| block size | wall s | output tok/s |\n|---|---|---|")
        for r in result["blocks"]:
            print(f"| {r['block_size']} | {r['wall_s']:.1f} | {r['output_tok_s']:,.0f} |")
    if "budget" in parts:
        result["budget"] = batch_at_dynamic_budget(model, workload, 64)
        b = result["budget"]
        print(f"\nInside DynamicCache's KV memory for batches of 64 ({b['kv_budget_gib']:.2f} GiB): engine mean "
              f"running batch {b['engine_mean_running']:.1f}, max {b['engine_max_running']}, "
              f"preemptions {b['preemptions']}")
    (out / "sweeps.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        if "kernel" in result:
            ctx = [r["context"] for r in result["kernel"]]
            axes[0].plot(ctx, [r["sdpa_us"] for r in result["kernel"]], "k--", label="SDPA (contiguous)")
            for b in block_sizes:
                axes[0].plot(ctx, [r[f"bs{b}_us"] for r in result["kernel"]], marker="o", label=f"paged bs={b}")
            axes[0].set_xscale("log", base=2)
            axes[0].set_xlabel("context length")
            axes[0].set_ylabel("µs")
            axes[0].legend(fontsize=7)
        if "blocks" in result:
            axes[1].bar([str(r["block_size"]) for r in result["blocks"]], [r["output_tok_s"] for r in result["blocks"]])
            axes[1].set_xlabel("block size")
            axes[1].set_ylabel("output tok/s")
        fig.tight_layout()
        fig.savefig(out / "sweeps.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
