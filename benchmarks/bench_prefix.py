"""Shared-prefix workload (PagedAttention paper §6.4 "shared prefix"): hf_paged's engine, prefix caching on vs off.

Like the paper's translation setting: every request is a fixed few-shot prefix (a 1-shot prefix of about 80 tokens
and a 5-shot prefix of about 341 tokens) followed by a short distinct task input; all requests arrive at once. Token
ids are seeded random (the cache only looks at ids). EOS is ignored, so both runs produce the same tokens.

Reports, per prefix and per setting: prompt tokens computed (prefill work), the share of shared-prefix tokens served
from the cache for the requests after the first one, the engine's hit rate, and throughput (requests/s, output
tokens/s, total tokens/s). Prints a markdown table, writes JSON (and a PNG if matplotlib is importable) under
``--out``.

    python benchmarks/bench_prefix.py                       # CPU, a small random model
    python benchmarks/bench_prefix.py --device cuda --model llama-1b --num-requests 512
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import SHAPES, build_model, sync  # noqa: E402

SHAPES.setdefault(  # build_model looks shapes up in this (bench_generate's) dict
    "small",  # CPU-sized: big enough that a token of prefill costs real compute
    dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
         head_dim=64, vocab_size=32000, tie_word_embeddings=False),
)
PREFIXES = {"1-shot": 80, "5-shot": 341}


def make_workload(prefix_len: int, n: int, seed: int, task_len: tuple[int, int], out_len: tuple[int, int],
                  vocab: int) -> tuple[list[int], list[tuple[list[int], int]]]:
    """(prefix, [(prompt = prefix + task input, output length)]) from a seeded generator."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
    requests = []
    for _ in range(n):
        task = [rng.randrange(100, vocab) for _ in range(rng.randint(*task_len))]
        requests.append((prefix + task, rng.randint(*out_len)))
    return prefix, requests


def make_engine(model, args):
    """One engine for every run (pool sizing and CUDA-graph capture once); runs toggle its prefix caching."""
    import hf_paged

    engine = hf_paged.Engine(
        model, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory, use_cuda_graph=False if args.no_cuda_graph else None,
    )
    engine.warm_up()
    return engine


def run_engine(engine, requests, prefix_len: int, caching: bool, args) -> dict:
    """One run over every request (all queued at once), starting with an empty prefix cache."""
    import hf_paged

    bm = engine.block_manager
    bm.set_prefix_caching(False)  # drops whatever the previous run cached
    bm.set_prefix_caching(caching)
    before = dict(engine.stats)
    queried, hits = bm.prefix_query_tokens, bm.prefix_hit_tokens
    preempted = sum(engine.scheduler.num_preemptions.values())
    computed_prompt: dict[object, int] = {}
    first_start: dict[object, int] = {}
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        for item in out.scheduled:
            rid, prompt_len = item.group.request_id, item.seq.prompt_len
            first_start.setdefault(rid, item.start)  # the cached tokens it was admitted with
            if item.start < prompt_len:
                end = min(item.start + item.num_tokens, prompt_len)
                computed_prompt[rid] = computed_prompt.get(rid, 0) + end - item.start
        return out

    engine.scheduler.schedule = spy
    params = [hf_paged.SamplingParams(max_new_tokens=o, ignore_eos=True) for _, o in requests]
    gc.collect()
    sync(args.device)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = engine.generate([p for p, _ in requests], params)
    sync(args.device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    engine.scheduler.schedule = schedule
    ids = [o.request_id for o in outputs]
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outputs, requests))
    assert engine.kv_stats().used_blocks == 0, "blocks leaked"
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(n for _, n in requests)
    later = ids[1:]
    from_cache = sum(min(first_start[r], prefix_len) for r in later)
    queried, hits = bm.prefix_query_tokens - queried, bm.prefix_hit_tokens - hits
    return {
        "caching": caching,
        "wall_s": wall,
        "cpu_s": cpu,  # process CPU time (all threads)
        "steps": engine.stats["steps"] - before["steps"],
        "req_s": len(requests) / wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": sum(computed_prompt.values()),
        "prefix_from_cache_pct_after_first": 100.0 * from_cache / (prefix_len * len(later)) if later else 0.0,
        "hit_rate": hits / queried if queried else 0.0,
        "hit_tokens": hits,
        "evictions": bm.prefix_cache_stats().evictions,
        "preemptions": sum(engine.scheduler.num_preemptions.values()) - preempted,
        "_tokens": [o.outputs[0].token_ids for o in outputs],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=f"random-init shape ({', '.join(SHAPES)}) or a checkpoint path;"
                        " default: small on CPU, llama-1b on CUDA")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--num-requests", type=int, default=None, help="default: 48 on CPU, 512 on CUDA")
    parser.add_argument("--prefixes", default="1-shot,5-shot", help=f"comma list of {', '.join(PREFIXES)}")
    parser.add_argument("--task-len", type=int, nargs=2, default=(8, 24), help="task input length range")
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 32), help="output length range")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 2048 CPU, 8192 CUDA")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: sized by the engine)")
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting (interleaved); the best is reported")
    parser.add_argument("--out", default="benchmarks/results")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    cuda = args.device.startswith("cuda")
    args.model = args.model or ("llama-1b" if cuda else "small")
    args.num_requests = args.num_requests or (512 if cuda else 48)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (8192 if cuda else 2048)
    if args.num_blocks is None and args.kv_cache_memory is None and not cuda:
        args.num_blocks = 2048
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    model = build_model(args.model, args.device, dtype)
    vocab = model.config.get_text_config().vocab_size

    engine = make_engine(model, args)
    # warm-up (lazy initialisation, kernel autotuning) outside the timings
    _, warm = make_workload(64, 16, args.seed + 99, (4, 24), (2, 8), vocab)
    for caching in (False, True):
        run_engine(engine, warm, 64, caching, args)

    rows = []
    for name in args.prefixes.split(","):
        prefix_len = PREFIXES[name]
        _, requests = make_workload(prefix_len, args.num_requests, args.seed, tuple(args.task_len),
                                    tuple(args.output_len), vocab)
        results: dict[bool, dict] = {}
        walls: dict[bool, list[float]] = {False: [], True: []}
        cpus: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):  # interleaved, best of N: robust to other load on the machine
            for caching in (False, True):
                result = run_engine(engine, requests, prefix_len, caching, args)
                walls[caching].append(result["wall_s"])
                cpus[caching].append(result["cpu_s"])
                results.setdefault(caching, result)
        on_tokens, off_tokens = results[True].pop("_tokens"), results[False].pop("_tokens")
        # fp32: identical; bf16: K/V computed in another batch differ in rounding, so near-tied greedy picks can flip
        same = 100.0 * sum(a == b for a, b in zip(on_tokens, off_tokens)) / len(requests)
        for caching in (False, True):
            row = {"prefix": name, "prefix_len": prefix_len, **results[caching], "outputs_identical": same}
            wall = min(walls[caching])
            row.update(wall_s=wall, walls_s=walls[caching], cpu_s=min(cpus[caching]), cpus_s=cpus[caching],
                       req_s=len(requests) / wall,
                       output_tok_s=row["output_tok_s"] * row["wall_s"] / wall,
                       total_tok_s=row["total_tok_s"] * row["wall_s"] / wall)
            rows.append(row)
        for row in rows[-2:]:
            row["speedup"] = row["req_s"] / rows[-2]["req_s"]
            row["cpu_speedup"] = rows[-2]["cpu_s"] / row["cpu_s"]

    device_name = torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()}, " \
        f"{torch.get_num_threads()} threads)"
    meta = {"model": args.model, "device": device_name, "dtype": str(dtype).replace("torch.", ""),
            "num_requests": args.num_requests, "task_len": list(args.task_len), "output_len": list(args.output_len),
            "repeats": args.repeats, "num_blocks": engine.block_manager.num_blocks,
            "block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
            "torch": torch.__version__, "python": platform.python_version()}
    print(f"\n{meta}\n")
    print("| prefix | caching | prompt tokens | computed | prefix from cache (after 1st) | hit rate | steps | wall s "
          "| req/s | output tok/s | speedup (wall) | CPU s | speedup (CPU time) | outputs equal to off |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prefix']} ({r['prefix_len']} tok) | {'on' if r['caching'] else 'off'} | {r['prompt_tokens']:,} | "
              f"{r['prompt_tokens_computed']:,} | {r['prefix_from_cache_pct_after_first']:.1f}% | "
              f"{100 * r['hit_rate']:.1f}% | {r['steps']} | {r['wall_s']:.2f} | {r['req_s']:.2f} | "
              f"{r['output_tok_s']:,.0f} | {r['speedup']:.2f}x | {r['cpu_s']:.2f} | {r['cpu_speedup']:.2f}x | "
              f"{r['outputs_identical']:.0f}% |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"prefix_{args.model}_{'cuda' if cuda else 'cpu'}_{args.num_requests}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out / (stem + '.json')}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    names = list(dict.fromkeys(r["prefix"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    width = 0.38
    for k, caching in enumerate((False, True)):
        sel = [next(r for r in rows if r["prefix"] == n and r["caching"] == caching) for n in names]
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        label = "prefix caching " + ("on" if caching else "off")
        color = "#2a7" if caching else "#999"
        axes[0].bar(xs, [r["prompt_tokens_computed"] for r in sel], width, label=label, color=color)
        axes[1].bar(xs, [r["req_s"] for r in sel], width, label=label, color=color)
    for ax, title in zip(axes, ("prompt tokens computed", "requests / s")):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{args.model} on {'CUDA' if cuda else 'CPU'}, {args.num_requests} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    print(f"wrote {out / (stem + '.png')}")


if __name__ == "__main__":
    main()
