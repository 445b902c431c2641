"""End-to-end generation throughput: hf_paged's engine vs transformers `generate()` with `DynamicCache`.

Workloads come from a seeded generator (ShareGPT-like or Alpaca-like lognormal lengths) or a JSONL file of prompts;
EOS is ignored so every system produces exactly the requested number of tokens. Models are random-init named shapes
in bf16 (or a local checkpoint). Prints a markdown table, writes a JSON file and a PNG plot.

    python benchmarks/bench_generate.py --model llama-1b --workload sharegpt --num-requests 256 --out results/
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=False),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                         tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=32000, tie_word_embeddings=False),
}
WORKLOADS = {"sharegpt": (161, 338), "alpaca": (19, 58)}


def make_workload(kind: str, n: int, seed: int, max_len: int = 1024, jsonl: str | None = None):
    """[(prompt_ids, output_len)]: lognormal lengths (sigma 1) with the given means, clipped to [4, max_len]."""
    rng = np.random.default_rng(seed)
    if jsonl:
        rows = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()][:n]
        return [(list(r["prompt_ids"]), int(r.get("output_len", 128))) for r in rows]
    mean_in, mean_out = WORKLOADS[kind]
    sigma = 1.0

    def lengths(mean):
        mu = math.log(mean) - sigma**2 / 2
        return np.clip(rng.lognormal(mu, sigma, n).astype(int), 4, max_len)

    ins, outs = lengths(mean_in), lengths(mean_out)
    return [(rng.integers(100, 30000, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def build_model(name: str, device: str, dtype: torch.dtype):
    if name in SHAPES:
        shape = dict(SHAPES[name])
        model_type = shape.pop("model_type", "llama")
        config = AutoConfig.for_model(model_type, max_position_embeddings=4096, **shape)
        config.eos_token_id = None
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa").to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_dynamic(model, workload, batch_size: int, device: str, progress: bool):
    """transformers generate() + DynamicCache: fixed batches in arrival order, left padding, run to the longest."""
    from tqdm.auto import tqdm

    computed = 0
    batches = [workload[i : i + batch_size] for i in range(0, len(workload), batch_size)]
    for batch in tqdm(batches, desc="DynamicCache", disable=not progress):
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=0)
        computed += longest * len(batch)
    return {"computed_tokens": computed}


def run_generate_batch(model, workload, use_cuda_graph: bool, progress: bool):
    """transformers' own continuous batching (paged sdpa), each request with its own max_new_tokens."""
    from tqdm.auto import tqdm
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                              max_new_tokens=max(o for _, o in workload))
    cb_config = ContinuousBatchingConfig(use_cuda_graph=use_cuda_graph)
    done = 0
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5
    ) as manager:
        for prompt, out_len in workload:
            manager.add_request(prompt, max_new_tokens=out_len)
        bar = tqdm(total=len(workload), desc="generate_batch", disable=not progress)
        while done < len(workload):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        bar.close()
    return {"finished": done}


def run_paged(model, workload, args, progress: bool):
    """hf_paged's engine; wall time includes its start-up (memory profiling, pool, CUDA graph capture)."""
    import hf_paged

    setup_start = time.perf_counter()
    engine = hf_paged.Engine(model, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                             use_cuda_graph=None if not args.no_cuda_graph else False,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             gpu_memory_utilization=args.gpu_memory_utilization,
                             kv_cache_memory=args.kv_cache_memory)
    if engine.runner.use_cuda_graph:
        engine.runner.capture_all()
    sync(args.device)
    setup_s = time.perf_counter() - setup_start  # profiling, pool allocation, graph capture (inside wall_s too)
    params = [hf_paged.SamplingParams(max_new_tokens=o, ignore_eos=True) for _, o in workload]
    waste = []
    ids = [engine.add_request(p, params=sp) for (p, _), sp in zip(workload, params)]
    done = 0
    from tqdm.auto import tqdm

    bar = tqdm(total=len(ids), desc="hf_paged", disable=not progress)
    while engine.has_unfinished():
        for out in engine.step(finished_only=True):
            if out.finished:
                done += 1
                bar.update(1)
        if engine.stats["steps"] % 16 == 0:
            s = engine.kv_stats()
            if s.allocated_slots:
                waste.append(s.waste_slots / s.allocated_slots)
    bar.close()
    steps = max(1, engine.stats["steps"])
    return {
        "setup_s": setup_s,
        "num_blocks": engine.block_manager.num_blocks,
        "steps": engine.stats["steps"],
        "mean_running_batch": engine.stats["running_sum"] / steps,
        "max_running_batch": engine.stats["max_running"],
        "kv_waste_pct": 100 * float(np.mean(waste)) if waste else 0.0,
        "preemptions": sum(engine.scheduler.num_preemptions.values()),
        "graph_steps": engine.runner.graph_steps,
        "eager_steps": engine.runner.eager_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--workload", default="sharegpt", choices=sorted(WORKLOADS))
    parser.add_argument("--jsonl", default=None, help="prompts as JSON lines {prompt_ids: [...], output_len: N}")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="paged,generate_batch_graphs,dynamic",
                        help="comma list of: paged, generate_batch, generate_batch_graphs, dynamic")
    parser.add_argument("--dynamic-batch-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile the hf_paged run into OUT/profile_paged.txt")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    workload = make_workload(args.workload, args.num_requests, args.seed, jsonl=args.jsonl)
    output_tokens = sum(o for _, o in workload)
    model = build_model(args.model, args.device, dtype)
    progress = not args.no_progress
    rows = []
    for system in args.systems.split(","):
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        sync(args.device)
        start = time.perf_counter()
        if system == "dynamic":
            extra = run_dynamic(model, workload, args.dynamic_batch_size, args.device, progress)
        elif system in ("generate_batch", "generate_batch_graphs"):
            extra = run_generate_batch(model, workload, system.endswith("graphs"), progress)
        elif system == "paged" and args.profile:
            import cProfile
            import io
            import pstats

            profiler = cProfile.Profile()
            extra = profiler.runcall(run_paged, model, workload, args, progress)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "profile_paged.txt").write_text(text.getvalue())
        elif system == "paged":
            extra = run_paged(model, workload, args, progress)
        else:
            raise SystemExit(f"unknown system {system!r}")
        sync(args.device)
        wall = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
        rows.append({"system": system, "wall_s": wall, "output_tok_s": output_tokens / wall,
                     "req_s": len(workload) / wall, "peak_gib": peak, **extra})
        if system == "paged":
            import hf_paged

            hf_paged.disable(model)
            model._hf_paged_engine = None
    base = {r["system"]: r["output_tok_s"] for r in rows}
    meta = {
        "model": args.model, "workload": args.workload, "num_requests": len(workload),
        "mean_input": float(np.mean([len(p) for p, _ in workload])), "mean_output": output_tokens / len(workload),
        "output_tokens": output_tokens, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
    }
    import transformers

    meta["transformers"] = transformers.__version__
    print(f"\n{meta}\n")
    print("| system | wall s | output tok/s | req/s | x dynamic | x generate_batch | peak GiB | mean batch | KV waste % |")
    print("|---|---|---|---|---|---|---|---|---|")
    cb = base.get("generate_batch_graphs", base.get("generate_batch"))
    for r in rows:
        ratio = r["output_tok_s"] / base["dynamic"] if "dynamic" in base else float("nan")
        ratio_cb = r["output_tok_s"] / cb if cb else float("nan")
        print(f"| {r['system']} | {r['wall_s']:.1f} | {r['output_tok_s']:,.0f} | {r['req_s']:.2f} | {ratio:.2f} | "
              f"{ratio_cb:.2f} | "
              f"{r['peak_gib']:.1f} | {r.get('mean_running_batch', float('nan')):.1f} | "
              f"{r.get('kv_waste_pct', float('nan')):.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"generate_{args.model}_{args.workload}_{len(workload)}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        colors = ["#2a7" if r["system"] == "paged" else "#999" for r in rows]
        ax.bar([r["system"] for r in rows], [r["output_tok_s"] for r in rows], color=colors)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{args.model}, {args.workload}, {len(workload)} requests")
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
