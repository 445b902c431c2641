"""Microbenchmark of one mixture-of-experts layer's experts: hf_paged's fused experts (the ``hf_paged`` entry of
transformers' ``ExpertsInterface``) vs transformers' ``grouped_mm``, ``batched_mm`` and ``eager`` experts, in one
process, against the bytes bound.

For the experts of OLMoE-1B-7B (64 experts, top-8, hidden 2048, intermediate 1024), Qwen3-30B-A3B (128, top-8,
2048, 768), gpt-oss-20b (32, top-4, 2880, 2880: clamped SwiGLU with interleaved gate/up, transposed weights,
biases) and Mixtral-8x7B (8, top-2, 4096, 14336), built from transformers' own experts classes with random weights,
and for each row count (decode batches, 1..512 tokens), one seeded routing (softmax of random logits, top-k) feeds
every implementation, which is timed as the engine runs it: replayed from a CUDA graph where it can be captured
(``hf_paged``, ``grouped_mm``, ``batched_mm``; ``eager`` syncs the host, so it runs as is), L2 flushed before each
repetition, median of ``--reps``. The bound is the bytes one call must read at the measured copy bandwidth
(``roofline.copy_bandwidth``): the weights (and biases) of the experts the routing hits, plus the tokens in and
out. Every output is checked against the ``eager`` experts (bf16 tolerance); a mismatch fails the run.

Prints a markdown table (µs, fraction of the bound, hf_paged's speed-up over ``grouped_mm``), writes ``moe.json``
and (with matplotlib) ``moe.png`` under ``--out``. ``--tune`` also times the Triton kernels' candidate block sizes
(`triton_moe.candidate_configs`) per shape and row count, each GEMM apart, and prints the best next to the table's.

    PYTHONPATH=. python benchmarks/bench_moe.py --out benchmarks/results/<dir>/moe
    PYTHONPATH=. python benchmarks/bench_moe.py --shapes olmoe --tune --out /tmp/moe_tune
    PYTHONPATH=. python benchmarks/bench_moe.py --device cpu --tiny --out /tmp/moe   # the CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward  # noqa: E402

from hf_paged.attention import experts as hf_experts  # noqa: E402

# name -> (model_type, experts class, config fields); the tiny variants keep the experts and top-k, shrink the dims
SHAPES = {
    "olmoe": ("olmoe", "OlmoeExperts", dict(hidden_size=2048, intermediate_size=1024, num_experts=64,
                                            num_experts_per_tok=8)),
    "qwen3-moe": ("qwen3_moe", "Qwen3MoeExperts", dict(hidden_size=2048, moe_intermediate_size=768,
                                                       num_experts=128, num_experts_per_tok=8)),
    "gpt-oss": ("gpt_oss", "GptOssExperts", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                                 num_experts_per_tok=4)),
    "mixtral": ("mixtral", "MixtralExperts", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                                  num_experts_per_tok=2)),
}
TINY = dict(hidden_size=64, intermediate_size=32, moe_intermediate_size=32)
SYSTEMS = ("hf_paged", "grouped_mm", "batched_mm", "eager")
BATCHED_MM_LIMIT = 8 << 30  # batched_mm gathers every slot's weights: skip it past this many bytes


def build_experts(name: str, device: str, dtype: torch.dtype, tiny: bool = False, seed: int = 0):
    """(experts module, top-k) of a named shape, random weights (std 0.02, biases 0.1)."""
    model_type, class_name, fields = SHAPES[name]
    fields = dict(fields)
    if tiny:
        fields.update({k: v for k, v in TINY.items() if k in fields})
    config = AutoConfig.for_model(model_type, **fields)
    cls = getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), class_name)
    torch.manual_seed(seed)
    with torch.device(device):
        module = cls(config).to(dtype)
    with torch.no_grad():
        for pname, p in module.named_parameters():
            p.normal_(0, 0.1 if pname.endswith("bias") else 0.02)
    return module.eval(), int(config.num_experts_per_tok)


def routing(rows: int, num_experts: int, top_k: int, device: str, dtype: torch.dtype, seed: int):
    """(top_k_index, top_k_weights) of `rows` tokens: softmax over random logits, top-k, renormalised."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, num_experts, generator=g)
    weights, index = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return index.to(device), weights.to(dtype).to(device)


def bytes_read(module, index: torch.Tensor, rows: int, elem: int) -> int:
    """Weights (and biases) of the experts `index` names, plus the tokens in and out."""
    hit = torch.unique(index).numel()
    per_expert = sum(p[0].numel() * p.element_size() for p in module.parameters())
    hidden = module.down_proj.shape[-1] if module.is_transposed else module.down_proj.shape[1]
    return hit * per_expert + 2 * rows * hidden * elem


def bandwidth(device: str) -> float:
    """Bytes per second of a large copy (read + write) on `device`."""
    if device.startswith("cuda"):
        from roofline import copy_bandwidth

        return copy_bandwidth(device)
    src = torch.empty(1 << 25, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times)


def time_us(fn, device: str, reps: int, graph: bool, flush: torch.Tensor | None) -> tuple[float, str]:
    """Median µs of `fn()` (the L2 flushed before each call on CUDA) and how it ran: "graph" or "eager"."""
    fn()
    fn()
    if not device.startswith("cuda"):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6, "eager"
    run, mode = fn, "eager"
    if graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                fn()
            run, mode = cuda_graph.replay, "graph"
        except Exception:  # noqa: BLE001 - a host sync inside: time it as it runs
            torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times), mode


def implementations(module):
    eager = type(module).forward.__wrapped__
    return {"hf_paged": hf_experts.experts_forward, "grouped_mm": grouped_mm_experts_forward,
            "batched_mm": batched_mm_experts_forward, "eager": eager}


def tune(module, x, index, weights, device, reps, flush) -> dict:
    """Best block sizes of each GEMM per BLOCK_M (times of `experts_up` / `experts_down` apart)."""
    from hf_paged.kernels import triton_moe

    spec = hf_experts.experts_spec(module)
    w_up, up_bias, w_down, down_bias = spec.weights(module)
    ids, w = index.contiguous(), weights.contiguous()
    inter = w_down.shape[2]
    best, seen = {}, set()
    for config in triton_moe.candidate_configs():
        fitted = triton_moe.fitted(config, w_up.shape[2], inter, inter, w_up.element_size())
        if fitted in seen:  # several candidates fit down to one config
            continue
        seen.add(fitted)
        routing_ = triton_moe.align(ids, w_up.shape[0], fitted.block_m)
        mid = triton_moe.experts_up(x, ids, w_up, up_bias, spec.activation, inter, fitted, routing_)
        for half, fn in (("up", partial(triton_moe.experts_up, x, ids, w_up, up_bias, spec.activation, inter, fitted,
                                         routing_)),
                         ("down", partial(triton_moe.experts_down, mid, ids, w, w_down, down_bias, x.dtype, fitted,
                                          routing_))):
            try:
                us, _ = time_us(fn, device, reps, True, flush)
            except Exception:  # noqa: BLE001 - a tile that does not fit (shared memory): skip it
                continue
            key = (fitted.block_m, half)
            if key not in best or us < best[key][0]:
                best[key] = (us, getattr(fitted, half))
    out = {}
    for block_m in sorted({m for m, _ in best}):
        if (block_m, "up") in best and (block_m, "down") in best:
            (up_us, up), (down_us, down) = best[(block_m, "up")], best[(block_m, "down")]
            out[block_m] = {"us": up_us + down_us, "up": up, "down": down}
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512", help="comma list of token counts")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, intermediate 32 (the CPU smoke run)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-graphs", action="store_true", help="time every system as eager launches")
    parser.add_argument("--tune", action="store_true", help="also time the kernels' candidate block sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/moe")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    for name in shapes:
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}: choose from {', '.join(SHAPES)}")
    for name in systems:
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    rows_list = [int(r) for r in args.rows.split(",") if r]
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                           else torch.float32)
    cuda = args.device.startswith("cuda")
    flush = torch.empty(256 << 20, dtype=torch.int8, device=args.device) if cuda else None
    bw = bandwidth(args.device)
    hf_experts.register()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    records, failures = [], []
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, {dtype}, copy bandwidth {bw / 1e12:.2f} TB/s\n")
    header = "| shape | rows | experts hit | MB read | bound µs | " + " | ".join(
        f"{s} µs (of bound)" for s in systems) + " | hf_paged vs grouped_mm |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name in shapes:
        module, top_k = build_experts(name, args.device, dtype, args.tiny, args.seed)
        spec = hf_experts.experts_spec(module)
        if spec is None or spec.activation is None:
            raise SystemExit(f"{name}: the hf_paged experts cannot fuse this module ({spec})")
        functions = implementations(module)
        hidden = module.gate_up_proj.shape[1] if module.is_transposed else module.gate_up_proj.shape[2]
        for rows in rows_list:
            index, weights = routing(rows, module.num_experts, top_k, args.device, dtype, args.seed + rows)
            x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(dtype).to(args.device)
            read = bytes_read(module, index, rows, x.element_size())
            record = {"shape": name, "rows": rows, "top_k": top_k, "experts_hit": int(torch.unique(index).numel()),
                      "bytes": read, "bound_us": read / bw * 1e6, "dtype": str(dtype), "tiny": args.tiny}
            with torch.no_grad():
                expected = functions["eager"](module, x, index, weights).float()
                for system in systems:
                    if system == "batched_mm" and rows * top_k * read / max(1, record["experts_hit"]) > BATCHED_MM_LIMIT:
                        record[system] = None  # its gathered weights would not fit
                        continue
                    fn = functions[system]
                    got = fn(module, x, index, weights).float()
                    err = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6))
                    if err > (2e-2 if dtype != torch.float32 else 1e-4):
                        failures.append(f"{name} rows {rows} {system}: relative error {err:.2e} against eager")
                    us, mode = time_us(partial(fn, module, x, index, weights), args.device, args.reps,
                                       not args.no_graphs and system != "eager", flush)
                    record[system] = {"us": us, "mode": mode, "fraction": record["bound_us"] / us, "error": err}
                if args.tune and cuda:
                    record["tune"] = {str(m): v for m, v in tune(module, x, index, weights, args.device, args.reps,
                                                                  flush).items()}
            records.append(record)
            cells = []
            for system in systems:
                r = record.get(system)
                cells.append("skipped" if r is None else
                             f"{r['us']:.1f}{'' if r['mode'] == 'graph' or not cuda else '*'} ({r['fraction']:.0%})")
            ratio = (record["grouped_mm"]["us"] / record["hf_paged"]["us"]
                     if record.get("grouped_mm") and record.get("hf_paged") else float("nan"))
            record["speedup_vs_grouped_mm"] = ratio
            print(f"| {name} | {rows} | {record['experts_hit']} | {read / 1e6:.1f} | {record['bound_us']:.1f} | "
                  + " | ".join(cells) + f" | {ratio:.2f}x |", flush=True)
            if "tune" in record:
                best = min(record["tune"].items(), key=lambda kv: kv[1]["us"], default=None)
                if best:
                    print(f"|   tune | {rows} | best BLOCK_M {best[0]}: up {best[1]['up']}, down {best[1]['down']}, "
                          f"{best[1]['us']:.1f} µs (kernels alone) |")
        del module
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        print("\n`*`: timed as eager launches (it syncs the host); the others replay a CUDA graph")
    (out_dir / "moe.json").write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                                  "copy_bytes_s": bw, "torch": torch.__version__,
                                                  "command": " ".join(sys.argv), "records": records}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.2), squeeze=False)
        for ax, name in zip(axes[0], shapes):
            rows_of = [r for r in records if r["shape"] == name]
            for system in systems:
                points = [(r["rows"], r[system]["fraction"]) for r in rows_of if r.get(system)]
                if points:
                    ax.plot(*zip(*points), marker="o", label=system)
            ax.set_xscale("log", base=2)
            ax.set_title(name)
            ax.set_xlabel("rows")
            ax.set_ylabel("fraction of the bytes bound")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "moe.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")
    if failures:
        raise SystemExit("outputs differ from the eager experts:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()
