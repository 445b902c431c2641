"""Split-K count of the paged decode kernel, per shape: the heuristic's choice against forced counts (GPU only).

Each configuration is timed as 20 calls captured in one CUDA graph (median of 20 replays): timing Python calls would
measure the dispatch instead of the kernel for the short ones. Shapes: the four anchor shapes of
`bench_decode_kernel.py` and the B=32 context sweep of `bench_sweeps.py` (block size 16, shuffled blocks, bf16).
Prints a table (µs; the best count per shape marked) and writes JSON.

    python benchmarks/bench_decode_splits.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_paged import kernels  # noqa: E402

SHAPES = [  # (batch, context, q heads, kv heads, head_dim)
    (64, 2048, 32, 8, 128), (256, 512, 32, 8, 64), (8, 8192, 32, 8, 128), (128, 1024, 32, 8, 128),
    (32, 512, 32, 8, 128), (32, 1024, 32, 8, 128), (32, 2048, 32, 8, 128), (32, 4096, 32, 8, 128),
    (32, 8192, 32, 8, 128),
]


def graph_time_us(fn, calls: int = 20, replays: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / calls * 1e3)
    return sorted(times)[len(times) // 2]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--splits", default="1,2,3,4,6,8,12,16,24,32")
    parser.add_argument("--out", default="benchmarks/results")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_splits.py needs a GPU")
    from hf_paged.kernels import triton_decode  # triton: imported here, so that importing graph_time_us needs none

    counts = [int(s) for s in args.splits.split(",")]
    block = 16
    rows = []
    print("| B | L | d | SDPA µs | heuristic (splits) µs | " + " | ".join(f"{c}" for c in counts) + " |")
    print("|---" * (5 + len(counts)) + "|")
    for batch, length, hq, hkv, d in SHAPES:
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        nblk = -(-length // block)
        total = batch * nblk
        kc = torch.randn(total, hkv, block, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        tables = torch.randperm(total, device="cuda").view(batch, nblk).to(torch.int32)
        lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        k = torch.randn(batch, hkv, length, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sdpa = graph_time_us(partial(torch.nn.functional.scaled_dot_product_attention, q[:, :, None], k, v,
                                     enable_gqa=True))
        chosen = triton_decode.choose_num_splits(batch, hkv, length, triton_decode._CONFIGS[d][0], q.device)
        call = partial(kernels.paged_decode, q, kc, vc, tables, lens, d**-0.5)
        heuristic = graph_time_us(call)
        forced = {}
        for c in counts:
            triton_decode.FORCE_NUM_SPLITS = c
            try:
                forced[c] = graph_time_us(call)
            finally:
                triton_decode.FORCE_NUM_SPLITS = None
        best = min(forced, key=forced.get)
        rows.append({"batch": batch, "context": length, "head_dim": d, "sdpa_us": sdpa, "heuristic_splits": chosen,
                     "heuristic_us": heuristic, "forced_us": forced, "best_splits": best})
        cells = " | ".join(f"**{forced[c]:.1f}**" if c == best else f"{forced[c]:.1f}" for c in counts)
        print(f"| {batch} | {length} | {d} | {sdpa:.1f} | {heuristic:.1f} ({chosen}) | {cells} |", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_splits_h100.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                             "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
