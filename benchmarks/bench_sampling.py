"""GPU microbenchmark: `hf_paged.kernels.sampling.sample_tokens` (Triton, no sort) vs a sort-based torch sampler vs
the bound, reading the ``[rows, vocab]`` float32 logits once at the measured copy bandwidth.

For rows in 1..256 and vocab 32,000 / 128,256 / 151,936, and parameter sets ``greedy`` (temperature 0: argmax),
``t0.6-p0.95`` (the sampled bench_generate workload), ``t0.8-k50`` and ``t0.7-k50-p0.9-m0.05``, it times with
``triton.testing.do_bench`` (median, L2 flushed):

* ``kernel``: ``sample_tokens`` on the Triton path,
* ``torch``: temperature, ``topk`` threshold, ``sort`` + ``softmax`` + ``cumsum`` for top-p, min-p, then an
  exponential-race draw (what transformers' warpers + multinomial cost on the device, batched),
* ``bound``: ``rows * vocab * 4`` bytes / copy bandwidth (``roofline.copy_bandwidth``: read + write bytes of a large
  device copy per second),

prints a markdown table (µs and the kernel's fraction of the bound), writes ``sampling.json`` and ``sampling.png``
under ``--out``. A second table times the all-greedy pick as the engine's picker runs it (``greedy_picker``: a
Triton argmax spread over every SM while there are no more rows than SMs, torch's above) against
``torch.argmax(dim=-1)``, for float32 and bfloat16 logits, and checks they agree.

    PYTHONPATH=. python benchmarks/bench_sampling.py --out /tmp/bench [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from hf_paged.kernels.sampling import greedy_picker, sample_tokens  # noqa: E402

PARAMS = {  # name -> (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "t0.6-p0.95": (0.6, 0, 0.95, 0.0),
    "t0.8-k50": (0.8, 50, 1.0, 0.0),
    "t0.7-k50-p0.9-m0.05": (0.7, 50, 0.9, 0.05),
}


def torch_sort_sampler(logits, temperature, top_k, top_p, min_p, generator):
    """Batched sort-based sampler (the torch path the kernel replaces); greedy rows where temperature is 0."""
    greedy = logits.argmax(dim=-1)
    x = logits.float() / temperature.clamp_min(1e-6)[:, None]
    vocab = x.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    sorted_x, order = x.sort(dim=-1, descending=True)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    x = x.masked_fill(x < kth, -float("inf"))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, -float("inf"))
    cum = sorted_x.softmax(-1).cumsum(-1)
    remove_sorted = (cum - sorted_x.softmax(-1)) >= top_p[:, None]
    remove_sorted[:, 0] = False
    x = x.masked_fill(remove_sorted.scatter(1, order, remove_sorted), -float("inf"))
    probs = x.softmax(-1)
    x = x.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, -float("inf"))
    probs = x.softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.where(temperature > 0, (probs / noise).argmax(-1), greedy)


def _time_one(logits, name, values, gen, bw, do_bench) -> dict:
    rows, vocab = logits.shape
    t, k, p, m = values

    def col(v, dtype):
        return torch.full((rows,), v, dtype=dtype, device="cuda")

    temp, top_k, top_p, min_p = col(t, torch.float32), col(k, torch.long), col(p, torch.float32), col(m, torch.float32)
    seed = torch.arange(rows, device="cuda") * 1000 + 7
    offset = torch.full((rows,), 100, dtype=torch.long, device="cuda")
    kernel_ms = do_bench(lambda: sample_tokens(logits, temp, top_k, top_p, min_p, seed, offset), warmup=10, rep=50)
    torch_ms = do_bench(lambda: torch_sort_sampler(logits, temp, top_k, top_p, min_p, gen), warmup=5, rep=30)
    bound_ms = rows * vocab * 4 / bw * 1e3
    return dict(params=name, rows=rows, vocab=vocab, kernel_us=kernel_ms * 1e3, torch_us=torch_ms * 1e3,
                bound_us=bound_ms * 1e3, kernel_fraction_of_bound=bound_ms / kernel_ms,
                torch_fraction_of_bound=bound_ms / torch_ms)


def graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """GPU time of one `fn()` in ms: `calls` calls recorded in a CUDA graph, replayed. The engine launches the pick
    right behind the step's graph, so the host's launch cost overlaps the GPU; `do_bench` would time the launches of
    a kernel this short, not the kernel."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / (calls * replays)


def time_argmax(rows_list, vocabs, bw) -> list[dict]:
    """The engine's greedy pick (`greedy_picker`) vs `torch.argmax` on random logits with ties (values rounded), float32 and bfloat16, GPU time of
    each in a CUDA graph (`graph_ms`)."""
    out = []
    pick = greedy_picker("cuda")
    print("\n| greedy pick | dtype | rows | vocab | greedy_picker µs | torch.argmax µs | bound µs | greedy_picker/bound | "
          "torch/greedy_picker |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in vocabs:
            for rows in rows_list:
                logits = (torch.randn(rows, vocab, device="cuda") * 4).round().to(dtype)
                if not torch.equal(pick(logits), logits.argmax(dim=-1)):
                    raise SystemExit(f"greedy_picker differs from torch.argmax at {rows} x {vocab} {dtype}")
                ours = graph_ms(lambda x=logits: pick(x))
                ref = graph_ms(lambda x=logits: x.argmax(dim=-1))
                bound = rows * vocab * logits.element_size() / bw * 1e3
                row = dict(dtype=str(dtype).replace("torch.", ""), rows=rows, vocab=vocab, greedy_picker_us=ours * 1e3,
                           torch_argmax_us=ref * 1e3, bound_us=bound * 1e3)
                out.append(row)
                print(f"| | {row['dtype']} | {rows} | {vocab} | {ours * 1e3:.1f} | {ref * 1e3:.1f} | {bound * 1e3:.1f} | "
                      f"{bound / ours:.0%} | {ref / ours:.1f}x |", flush=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--greedy-only", action="store_true", help="only the greedy-pick table")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_sampling.py needs CUDA")
    import triton.testing
    from roofline import copy_bandwidth

    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    rows_list = [1, 8, 24, 64, 256] if args.quick else [1, 4, 16, 24, 32, 64, 128, 256]
    vocabs = [32000, 151936] if args.quick else [32000, 128256, 151936]
    vocabs = [32000, 128256] if args.quick and args.greedy_only else vocabs
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    print("| params | rows | vocab | kernel µs | torch µs | bound µs | kernel/bound | torch/kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for vocab in vocabs if not args.greedy_only else []:
        for rows in rows_list:
            logits = torch.randn(rows, vocab, device="cuda") * 4
            for name, values in PARAMS.items():
                row = _time_one(logits, name, values, gen, bw, triton.testing.do_bench)
                results.append(row)
                print(f"| {name} | {rows} | {vocab} | {row['kernel_us']:.1f} | {row['torch_us']:.1f} | "
                      f"{row['bound_us']:.1f} | {row['kernel_fraction_of_bound']:.0%} | "
                      f"{row['torch_us'] / row['kernel_us']:.1f}x |", flush=True)
            del logits
    greedy_picks = time_argmax(rows_list, vocabs, bw)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_bandwidth_bytes_per_s=bw)
    with open(os.path.join(args.out, "sampling.json"), "w") as f:
        json.dump(dict(meta=meta, results=results, greedy_picks=greedy_picks), f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return
    fig, axes = plt.subplots(1, len(vocabs), figsize=(6 * len(vocabs), 4.5), squeeze=False)
    for ax, vocab in zip(axes[0], vocabs):
        for name in PARAMS:
            sel = [r for r in results if r["vocab"] == vocab and r["params"] == name]
            ax.plot([r["rows"] for r in sel], [r["kernel_us"] for r in sel], marker="o", label=f"kernel {name}")
            ax.plot([r["rows"] for r in sel], [r["torch_us"] for r in sel], ls=":", marker="x", label=f"torch {name}")
        sel = [r for r in greedy_picks if r["vocab"] == vocab and r["dtype"] == "float32"]
        ax.plot([r["rows"] for r in sel], [r["greedy_picker_us"] for r in sel], marker="s", label="greedy pick fp32")
        ax.plot([r["rows"] for r in sel], [r["torch_argmax_us"] for r in sel], ls="--", label="torch.argmax fp32")
        sel = [r for r in results if r["vocab"] == vocab and r["params"] == "greedy"]
        ax.plot([r["rows"] for r in sel], [r["bound_us"] for r in sel], color="k", lw=2, label="bound")
        ax.set(xscale="log", yscale="log", xlabel="rows", ylabel="µs", title=f"vocab {vocab}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "sampling.png"), dpi=120)


if __name__ == "__main__":
    main()
