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

A third table times the top-k fast path (``sample_normalised(..., top_k_bound=k)``: ``torch.topk`` of each row's
largest logits, a candidate kernel, the full kernel for the rows those cannot decide) against the full kernel alone,
on bf16 logits, flat (``randn``, as a random-weight model's) and peaked (``randn * 2.5`` plus six tokens at +15), at
the Gemma-3 shape (262,144 tokens, T 1.0, top-k 64, top-p 0.95) and a Qwen shape (151,936, T 0.7, top-k 20, top-p
0.95), 1 / 64 / 240 rows: each path's time with ``do_bench`` (as called: launches included, L2 flushed) and its GPU
time replayed from a CUDA graph (`graph_ms`: what the engine's pick costs behind the step's graph), the
``torch.topk`` alone, and how many rows fell back to the full kernel. It checks that both paths give the same
tokens. ``--top-k-only`` runs only that table; ``--tiny`` runs it at small shapes on the CPU (torch backend).

``--topk-select torch,radix`` runs only a fourth table: the fast path with each way of selecting the candidate list
(``triton_topk_sampling.TOPK_SELECT``: ``torch.topk``, or the radix select of `triton_radix_select`) at the Gemma and
Qwen shapes, 1 / 8 / 64 / 240 flat rows of bf16 and float32 logits: the selection alone and the whole fast path,
each with ``do_bench`` and replayed from a CUDA graph, against the bytes bound (one read of the logits at the copy
bandwidth) and the full kernel. It checks that every selection gives torch.topk's values and the same tokens as the
full kernel, and writes ``topk_select.json``; with ``--radix-sweep``, then the radix select alone for each value of
each of its knobs (`SWEEP`, one at a time) at the Gemma shape.

    PYTHONPATH=. python benchmarks/bench_sampling.py --out /tmp/bench [--quick]
    PYTHONPATH=. python benchmarks/bench_sampling.py --out /tmp/bench --top-k-only
    PYTHONPATH=. python benchmarks/bench_sampling.py --out /tmp/bench --topk-select torch,radix [--radix-sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from hf_paged.kernels import _triton_module, get_backend, reference_sampling  # noqa: E402
from hf_paged.kernels.sampling import (  # noqa: E402
    candidate_count,
    greedy_picker,
    inverse_temperature,
    sample_normalised,
    sample_tokens,
)

PARAMS = {  # name -> (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "t0.6-p0.95": (0.6, 0, 0.95, 0.0),
    "t0.8-k50": (0.8, 50, 1.0, 0.0),
    "t0.7-k50-p0.9-m0.05": (0.7, 50, 0.9, 0.05),
}
TOP_K_SHAPES = {  # name -> (vocab, temperature, top_k, top_p): the top-k fast path's table
    "gemma3-t1.0-k64-p0.95": (262144, 1.0, 64, 0.95),
    "qwen-t0.7-k20-p0.95": (151936, 0.7, 20, 0.95),
}
TOP_K_ROWS = [1, 64, 240]
TINY_SHAPES = {"tiny-t1.0-k64-p0.95": (1024, 1.0, 64, 0.95), "tiny-t0.7-k20-p0.95": (800, 0.7, 20, 0.95)}
SELECT_ROWS = [1, 8, 64, 240]  # the selection table's (`time_topk_select`)
SELECT_DTYPES = (torch.bfloat16, torch.float32)


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


def top_k_logits(kind: str, rows: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    """bf16 logits: "flat" (``randn``) or "peaked" (``randn * 2.5``, six random tokens a row raised by 15)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, device=device)
    if kind == "peaked":
        x = x * 2.5
        x.scatter_add_(1, torch.randint(0, vocab, (rows, 6), generator=g, device=device),
                       torch.full((rows, 6), 15.0, device=device))
    return x.to(torch.bfloat16)


def _host_ms(fn, reps: int = 3) -> float:
    """Median wall time of `fn()` in ms (the CPU run)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _fallback_rows(logits, args, count) -> int:
    """Rows the candidates leave to the full kernel (-1), computed as the fast path does on this device."""
    values, indices = torch.topk(logits, count, dim=1)
    if get_backend(logits.device) == "triton":
        from hf_paged.kernels import triton_topk_sampling

        decided = triton_topk_sampling.candidate_tokens(values, indices, logits.shape[1], *args)
    else:
        decided = reference_sampling.candidate_tokens(values.cpu(), indices.cpu(), logits.shape[1],
                                                      *(a.cpu() for a in args))
    return int((decided < 0).sum())


def time_top_k(rows_list, shapes, device: str) -> list[dict]:
    """The top-k fast path vs the full kernel (module docstring), one markdown row per shape, logits kind and rows."""
    cuda = device == "cuda"
    if cuda:
        import triton.testing

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=50)
    else:
        timer = _host_ms
    out = []
    print("\n| top-k fast path | logits | rows | fallback rows | kernel µs | fast µs | topk µs | kernel/fast | "
          "kernel graph µs | fast graph µs | graph kernel/fast |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (vocab, temperature, k, p) in shapes.items():
        for kind in ("flat", "peaked"):
            for rows in rows_list:
                logits = top_k_logits(kind, rows, vocab, device, seed=rows)
                inv_t = torch.from_numpy(inverse_temperature([temperature] * rows)).to(device)
                args = (inv_t, torch.full((rows,), k, dtype=torch.int32, device=device),
                        torch.full((rows,), p, device=device), torch.full((rows,), -float("inf"), device=device),
                        torch.arange(rows, device=device) * 1000 + 7, torch.full((rows,), 100, device=device))
                count = candidate_count(k, vocab)

                def full(x=logits, a=args):
                    return sample_normalised(x, *a)

                def fast(x=logits, a=args, k=k):
                    return sample_normalised(x, *a, top_k_bound=k)

                if not torch.equal(full(), fast()):
                    raise SystemExit(f"the fast path's tokens differ: {name} {kind} {rows} rows")
                row = dict(shape=name, logits=kind, rows=rows, vocab=vocab, top_k=k, top_p=p, candidates=count,
                           fallback_rows=_fallback_rows(logits, args, count), kernel_us=timer(full) * 1e3,
                           fast_us=timer(fast) * 1e3, topk_us=timer(lambda x=logits, c=count: torch.topk(x, c)) * 1e3)
                row["kernel_graph_us"] = row["fast_graph_us"] = float("nan")
                if cuda:
                    row["kernel_graph_us"] = graph_ms(full) * 1e3
                    try:
                        row["fast_graph_us"] = graph_ms(fast) * 1e3
                    except Exception as exc:  # (a capture the fast path could not join: say so, time the rest)
                        print(f"fast path capture failed: {type(exc).__name__}: {exc}")
                out.append(row)
                print(f"| {name} | {kind} | {rows} | {row['fallback_rows']} | {row['kernel_us']:.1f} | "
                      f"{row['fast_us']:.1f} | {row['topk_us']:.1f} | {row['kernel_us'] / row['fast_us']:.2f}x | "
                      f"{row['kernel_graph_us']:.1f} | {row['fast_graph_us']:.1f} | "
                      f"{row['kernel_graph_us'] / row['fast_graph_us']:.2f}x |", flush=True)
                del logits
    return out


def select_logits(kind: str, rows: int, vocab: int, k: int, count: int, device: str) -> torch.Tensor:
    """float32 logits of the selection table: "flat" (`top_k_logits`' flat rows) or "masked" (every token -inf but
    ``(k + count) // 2``: more than k, fewer than the list, as a grammar's mask may leave; the radix select's bound
    is then -inf and its list overflows, so every row takes its radix passes: the worst case)."""
    x = top_k_logits("flat", rows, vocab, device, seed=rows).float()
    if kind == "masked":
        g = torch.Generator(device=device).manual_seed(rows + 1)
        keep = torch.rand(rows, vocab, generator=g, device=device).argsort(1)[:, : (k + count) // 2]
        x = torch.full_like(x, -float("inf")).scatter_(1, keep, x.gather(1, keep))
    return x


def time_topk_select(selects, rows_list, shapes, dtypes, bw: float, device: str = "cuda",
                     kinds=("flat", "masked")) -> list[dict]:
    """The fast path with each candidate selection (module docstring): one markdown row per shape, logits kind, dtype,
    rows and selection; refuses a selection whose values are not torch.topk's or whose tokens are not the full
    kernel's. On the CPU (the Triton backend under the interpreter, tiny shapes: the test of this table) host times,
    no graphs."""
    cuda = device == "cuda"
    if cuda:
        import triton.testing

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=50)

        graph = graph_ms
    else:

        def timer(fn):
            return _host_ms(fn, reps=1)

        def graph(fn):
            return float("nan")
    tt = _triton_module("triton_topk_sampling")
    saved = tt.TOPK_SELECT
    out = []
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; bound: one read of the logits at that rate")
    print("\n| top-k selection | shape | logits | dtype | rows | select | fallback rows | overflow rows | select µs | "
          "select graph µs | fast µs | fast graph µs | kernel graph µs | bound µs | bound/select graph | "
          "bound/fast graph |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    radix = _triton_module("triton_radix_select")
    try:
        for (name, (vocab, temperature, k, p)), kind, dtype, rows in itertools.product(shapes.items(), kinds, dtypes,
                                                                                       rows_list):
            logits = select_logits(kind, rows, vocab, k, candidate_count(k, vocab), device).to(dtype)
            inv_t = torch.from_numpy(inverse_temperature([temperature] * rows)).to(device)
            args = (inv_t, torch.full((rows,), k, dtype=torch.int32, device=device),
                    torch.full((rows,), p, device=device), torch.full((rows,), -float("inf"), device=device),
                    torch.arange(rows, device=device) * 1000 + 7, torch.full((rows,), 100, device=device))
            count = candidate_count(k, vocab)
            bound_us = rows * vocab * logits.element_size() / bw * 1e6
            want_values = torch.topk(logits, count, dim=1).values
            full = sample_normalised(logits, *args)
            kernel_graph_us = graph(lambda x=logits, a=args: sample_normalised(x, *a)) * 1e3
            for select in selects:
                tt.TOPK_SELECT = select
                values, indices = tt.select_candidates(logits, count)
                same = (values == want_values) | (values.isnan() & want_values.isnan())
                if not (bool(same.all()) and torch.equal(logits.gather(1, indices.long()), values)):
                    raise SystemExit(f"{select}: not torch.topk's values at {name} {dtype} {rows} rows")

                def fast(x=logits, a=args, k=k):
                    return sample_normalised(x, *a, top_k_bound=k)

                def select_only(x=logits, c=count):
                    return tt.select_candidates(x, c)

                if not torch.equal(fast(), full):
                    raise SystemExit(f"{select}: the fast path's tokens differ at {name} {dtype} {rows} rows")
                decided = tt.candidate_tokens(values, indices, vocab, *args)
                overflow = -1  # (torch.topk has no list)
                if select == "radix":
                    sizes = torch.zeros(rows, dtype=torch.int32, device=device)
                    radix.select_top(logits, count, sizes=sizes)
                    overflow = int((sizes > radix.list_cap(count)).sum())
                row = dict(shape=name, logits=kind, dtype=str(dtype).replace("torch.", ""), rows=rows,
                           vocab=vocab, top_k=k, top_p=p, candidates=count, select=select,
                           fallback_rows=int((decided < 0).sum()), overflow_rows=overflow,
                           select_us=timer(select_only) * 1e3,
                           select_graph_us=graph(select_only) * 1e3, fast_us=timer(fast) * 1e3,
                           fast_graph_us=graph(fast) * 1e3, kernel_graph_us=kernel_graph_us,
                           bound_us=bound_us)
                out.append(row)
                print(f"| | {name} | {kind} | {row['dtype']} | {rows} | {select} | {row['fallback_rows']} | "
                      f"{overflow} | "
                      f"{row['select_us']:.1f} | {row['select_graph_us']:.1f} | {row['fast_us']:.1f} | "
                      f"{row['fast_graph_us']:.1f} | {kernel_graph_us:.1f} | {bound_us:.1f} | "
                      f"{bound_us / row['select_graph_us']:.0%} | {bound_us / row['fast_graph_us']:.0%} |",
                      flush=True)
            del logits, want_values
    finally:
        tt.TOPK_SELECT = saved
    return out


SWEEP = {  # knob of `triton_radix_select` -> values the sweep tries, one knob at a time (the others at their default)
    "BLOCK": (1024, 2048, 4096),
    "NUM_WARPS": (4, 8, 16),
    "PROGRAMS_PER_SM": (2, 4, 8),
    "CAP_PER_COUNT": (4, 8),
    "GROUPS_PER_COUNT": (2, 4, 8),
}


def time_radix_sweep(bw: float, shape: str = "gemma3-t1.0-k64-p0.95", rows_list=(1, 240)) -> list[dict]:
    """The radix select alone (GPU time replayed from a CUDA graph) for each value of each of its knobs (`SWEEP`),
    flat bf16 and float32 rows of one shape; it checks each setting gives torch.topk's values."""
    radix = _triton_module("triton_radix_select")
    vocab, _, k, _ = TOP_K_SHAPES[shape]
    count = candidate_count(k, vocab)
    out = []
    print(f"\n| radix sweep ({shape}, count {count}) | knob | value | dtype | rows | select graph µs | bound µs | "
          "bound/select |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, rows in itertools.product(SELECT_DTYPES, rows_list):
        logits = top_k_logits("flat", rows, vocab, "cuda", seed=rows).to(dtype)
        want = torch.topk(logits, count, dim=1).values
        bound_us = rows * vocab * logits.element_size() / bw * 1e6
        for knob, values in SWEEP.items():
            default = getattr(radix, knob)
            try:
                for value in values:
                    setattr(radix, knob, value)
                    if not torch.equal(radix.select_top(logits, count)[0], want):
                        raise SystemExit(f"radix select with {knob}={value}: not torch.topk's values")
                    us = graph_ms(lambda x=logits: radix.select_top(x, count)) * 1e3
                    out.append(dict(knob=knob, value=value, dtype=str(dtype).replace("torch.", ""), rows=rows,
                                    select_graph_us=us, bound_us=bound_us))
                    print(f"| | {knob} | {value} | {out[-1]['dtype']} | {rows} | {us:.1f} | {bound_us:.1f} | "
                          f"{bound_us / us:.0%} |", flush=True)
            finally:
                setattr(radix, knob, default)
        del logits, want
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--greedy-only", action="store_true", help="only the greedy-pick table")
    ap.add_argument("--top-k-only", action="store_true", help="only the top-k fast path's table")
    ap.add_argument("--tiny", action="store_true", help="the top-k table at small shapes on the CPU")
    ap.add_argument("--topk-select", default=None, type=lambda v: [x for x in v.split(",") if x],
                    help="only the candidate-selection table, for these selections (e.g. torch,radix)")
    ap.add_argument("--radix-sweep", action="store_true",
                    help="with --topk-select: then the radix select's knobs, one at a time (Gemma shape)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.tiny:
        os.makedirs(args.out, exist_ok=True)
        results = time_top_k([1, 4], TINY_SHAPES, "cpu")
        with open(os.path.join(args.out, "top_k.json"), "w") as f:
            json.dump(dict(meta=dict(device="cpu", torch=torch.__version__), top_k=results), f, indent=1)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_sampling.py needs CUDA (or --tiny)")
    import triton.testing
    from roofline import copy_bandwidth

    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    if args.topk_select:
        unknown = set(args.topk_select) - set(_triton_module("triton_topk_sampling").SELECTS)
        if unknown:
            sys.exit(f"--topk-select: unknown selection(s) {sorted(unknown)}")
        bw = copy_bandwidth()
        results = time_topk_select(args.topk_select, SELECT_ROWS, TOP_K_SHAPES, SELECT_DTYPES, bw)
        sweep = time_radix_sweep(bw) if args.radix_sweep else []
        with open(os.path.join(args.out, "topk_select.json"), "w") as f:
            json.dump(dict(meta=dict(meta, copy_bandwidth_bytes_per_s=bw), topk_select=results, radix_sweep=sweep),
                      f, indent=1)
        return
    if args.top_k_only:
        results = time_top_k(TOP_K_ROWS, TOP_K_SHAPES, "cuda")
        with open(os.path.join(args.out, "top_k.json"), "w") as f:
            json.dump(dict(meta=meta, top_k=results), f, indent=1)
        return
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
    top_k = [] if args.greedy_only else time_top_k(TOP_K_ROWS, TOP_K_SHAPES, "cuda")
    meta["copy_bandwidth_bytes_per_s"] = bw
    with open(os.path.join(args.out, "sampling.json"), "w") as f:
        json.dump(dict(meta=meta, results=results, greedy_picks=greedy_picks, top_k=top_k), f, indent=1)
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
