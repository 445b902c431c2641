"""Beam-search throughput and KV memory: hf_paged's engine vs transformers' beam search (DynamicCache).

The workload of the project's beam anchor (../shared/anchors.md): random prompts of `--prompt-len` token ids in
[100, 30000) from `torch.Generator().manual_seed(seed)`, `num_beams` in `--beams`, exactly `--new-tokens` new tokens
(EOS disabled, so no beam ever stops early and both systems do the same work). Output tokens/s counts the returned
sequence of each prompt (prompts x new tokens), as the anchor does.

* transformers: `model.generate(num_beams=k)` with `DynamicCache` over `--hf-prompts-per-call` prompts at a time,
  after a small warm-up call (so its figure is steady state). Its KV memory is what `DynamicCache` holds for the
  beams at the end of a call: prompts x k x (prompt + new tokens) tokens (it only grows during a call).
* hf_paged: every prompt is one request of the engine (`num_beams=k`); the beams share KV blocks (fork, free,
  copy-on-write of a shared partial last block). Its KV memory is the peak of the blocks actually referenced, and
  the sharing saving is `1 - used / without sharing` per step and over the run. The engine of each width is built and
  warmed up (`Engine.warm_up()`: kernel compilation, CUDA-graph capture of every batch bucket) before the timed run,
  as transformers gets its warm-up call; that start-up is reported separately (`setup_s`).
* hf_paged_compiled: the same with `compile_decode=True` (the whole decode step compiled by Inductor, attention one
  hf_paged op, then captured as CUDA graphs).

Prints a markdown table, writes JSON and a PNG plot (tok/s and KV GiB vs beam width).

    python benchmarks/bench_beam.py --model llama-8b --beams 4,6,8              # on the GPU (default workload)
    python benchmarks/bench_beam.py --model tiny --device cpu --num-prompts 4 --prompt-len 16 --new-tokens 8
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_generate import StepTimer, build_model  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.cache import kv_bytes_per_token  # noqa: E402


def make_prompts(n: int, length: int, seed: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    high = min(30000, vocab)
    return torch.randint(min(100, high - 1), high, (n, length), generator=gen)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_transformers(model, prompts: torch.Tensor, k: int, args) -> dict:
    """transformers' beam search over chunks of `per_call` prompts; halves the chunk on OOM (recorded)."""
    per_call = min(args.hf_prompts_per_call, len(prompts))
    while True:
        free_memory(args.device)
        sync(args.device)
        start = time.perf_counter()
        try:
            for chunk in prompts.split(per_call):
                ids = chunk.to(args.device)
                with torch.inference_mode():
                    out = model.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=k, do_sample=False,
                        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, early_stopping=False,
                        eos_token_id=None, pad_token_id=0,
                    )
                assert out.shape == (len(chunk), args.prompt_len + args.new_tokens), out.shape
            sync(args.device)
            break
        except torch.cuda.OutOfMemoryError:
            if per_call == 1:
                raise
            per_call //= 2
            print(f"transformers num_beams={k}: out of memory, retrying with {per_call} prompts per call")
    wall = time.perf_counter() - start
    per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
    kv = per_call * k * (args.prompt_len + args.new_tokens) * per_token
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
    return {"wall_s": wall, "prompts_per_call": per_call, "kv_gib": kv / 2**30, "peak_gpu_gib": peak}


def run_paged(model, prompts: torch.Tensor, k: int, args, compile_decode: bool = False) -> dict:
    free_memory(args.device)
    sync(args.device)
    start = time.perf_counter()
    engine = hf_paged.Engine(
        model, block_size=args.block_size, max_num_seqs=len(prompts) * k, max_num_batched_tokens=args.max_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,  # random prompts share nothing; keep the measurement to sharing inside a request
        compile_decode=compile_decode,
    )
    engine.warm_up()
    sync(args.device)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    timer = StepTimer(engine)
    beam_times = {"beam_step_s": 0.0, "beam_host_s": 0.0}  # whole beam step (waits for the forward) / host part
    beam = engine.beam_search

    def timed(function, key):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = function(*a, **kw)
            beam_times[key] += time.perf_counter() - t
            return out

        return wrapper

    beam.step, beam._host_step = timed(beam.step, "beam_step_s"), timed(beam._host_step, "beam_host_s")
    params = hf_paged.SamplingParams(max_new_tokens=args.new_tokens, num_beams=k, ignore_eos=True)
    ids = [engine.add_request(p, params=params) for p in prompts.tolist()]
    series = []  # (used, without sharing) blocks at every step
    results = {}
    while engine.has_unfinished():
        for out in engine.step(finished_only=True):
            results[out.request_id] = out
        series.append(engine.block_manager.usage())
    sync(args.device)
    wall = time.perf_counter() - start
    assert set(results) == set(ids)
    assert all(len(results[i].outputs[0].token_ids) == args.new_tokens for i in ids)
    sharing = engine.sharing_stats()
    block_bytes = engine.cache.bytes_per_block(engine.dtype)
    steps_saving = [1 - used / logical for used, logical in series if logical]
    row = {
        "wall_s": wall,
        "setup_s": setup,
        "kv_gib": sharing.peak_used_blocks * block_bytes / 2**30,  # referenced at the peak
        "kv_gib_without_sharing": sharing.peak_logical_blocks * block_bytes / 2**30,
        "mean_saving_pct": 100 * sharing.mean_saving,
        "mean_step_saving_pct": 100 * sharing.mean_step_saving,
        "max_step_saving_pct": 100 * max(steps_saving, default=0.0),
        "steps": engine.stats["steps"],
        "graph_steps": engine.runner.graph_steps,
        "eager_steps": engine.runner.eager_steps,
        "num_blocks": engine.block_manager.num_blocks,
        "preemptions": sum(engine.scheduler.num_preemptions.values()),
        "saving_series": steps_saving[:: max(1, len(steps_saving) // 200)],
        "timing": timer.summary(),
        **beam_times,
    }
    engine.close()
    del engine
    return row


def warm_up_paged(model, args) -> None:
    """Compile the kernels (Triton) once, outside the timed runs."""
    engine = hf_paged.Engine(model, block_size=args.block_size, num_blocks=256, max_num_seqs=8,
                             enable_prefix_caching=False)
    prompts = make_prompts(2, 20, args.seed + 1, model.config.vocab_size).tolist()
    engine.generate(prompts, hf_paged.SamplingParams(max_new_tokens=4, num_beams=2, ignore_eos=True))
    engine.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-8b")
    parser.add_argument("--beams", default="4,6,8")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="paged,transformers")
    parser.add_argument("--hf-prompts-per-call", type=int, default=100)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8192, help="engine max_num_batched_tokens")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plot-only", default=None, help="redraw the plot of a results JSON and exit")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.plot_only:
        data = json.loads(Path(args.plot_only).read_text())
        plot(data["rows"], data["meta"], Path(args.plot_only).with_suffix(".png"))
        return
    if args.device == "cpu" and args.kv_cache_memory is None:
        args.kv_cache_memory = "1GiB"

    model = build_model(args.model, args.device, getattr(torch, args.dtype))
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.seed, model.config.vocab_size)
    output_tokens = args.num_prompts * args.new_tokens
    widths = [int(k) for k in args.beams.split(",")]
    systems = args.systems.split(",")
    import transformers

    meta = {
        "model": args.model, "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "seed": args.seed, "output_tokens": output_tokens,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "dtype": args.dtype, "command": " ".join(sys.argv),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"beam_{args.model}_{args.num_prompts}x{args.prompt_len}+{args.new_tokens}"
    rows = []

    def record(row: dict) -> None:  # written after every run: a time limit keeps what finished
        row["output_tok_s"] = output_tokens / row["wall_s"]
        rows.append(row)
        print(f"{row['system']} num_beams={row['num_beams']}: {row['output_tok_s']:,.0f} tok/s", flush=True)
        if "timing" in row:
            steps = {key: value for key, value in row["timing"].items() if key != "decode_by_batch"}
            print(f"  start-up {row['setup_s']:.1f} s, beam step {row['beam_step_s']:.2f} s (host part "
                  f"{row['beam_host_s']:.2f} s), steps {steps}", flush=True)
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    for system in ("paged", "paged_compiled"):
        if system in systems:
            warm_up_paged(model, args)
            for k in widths:
                row = run_paged(model, prompts, k, args, compile_decode=system == "paged_compiled")
                record({"system": "hf_" + system, "num_beams": k, **row})
            hf_paged.disable(model)
    if "transformers" in systems:
        with torch.inference_mode():  # warm-up call (kernel selection, allocator), not timed
            model.generate(input_ids=prompts[:2, :32].to(args.device), num_beams=2, max_new_tokens=4,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        for k in widths:
            record({"system": "transformers", "num_beams": k, **run_transformers(model, prompts, k, args)})
    print(f"\n{meta}\n")
    hf = {r["num_beams"]: r for r in rows if r["system"] == "transformers"}
    print("| system | beams | wall s (start-up s) | output tok/s | x transformers | KV GiB | KV vs transformers | sharing saved "
          "(mean / per-step mean / max) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = hf.get(r["num_beams"])
        speed = r["output_tok_s"] / base["output_tok_s"] if base else float("nan")
        kv = r["kv_gib"] / base["kv_gib"] if base else float("nan")
        saving = (f"{r['mean_saving_pct']:.1f} / {r['mean_step_saving_pct']:.1f} / {r['max_step_saving_pct']:.1f} %"
                  if r["system"].startswith("hf_paged") else "-")
        setup = f" ({r['setup_s']:.1f})" if "setup_s" in r else ""
        print(f"| {r['system']} | {r['num_beams']} | {r['wall_s']:.1f}{setup} | {r['output_tok_s']:,.0f} | {speed:.2f} | "
              f"{r['kv_gib']:.2f} | {100 * kv:.0f} % | {saving} |")
    plot(rows, meta, out / f"{stem}.png")


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    for system, color in (("hf_paged", "#2a7"), ("hf_paged_compiled", "#16a"), ("transformers", "#999")):
        sel = [r for r in rows if r["system"] == system]
        if sel:
            ax1.plot([r["num_beams"] for r in sel], [r["output_tok_s"] for r in sel], "o-", color=color, label=system)
            ax2.plot([r["num_beams"] for r in sel], [r["kv_gib"] for r in sel], "o-", color=color, label=system)
    ax1.set_xlabel("num_beams")
    ax1.set_ylabel("output tokens / s")
    ax1.set_ylim(bottom=0)
    ax2.set_xlabel("num_beams")
    ax2.set_ylabel("KV GiB")
    ax2.set_ylim(bottom=0)
    ax2.set_title("transformers: held at the end; hf_paged: referenced at the peak", fontsize=8)
    ax1.legend()
    fig.suptitle(f"beam search, {meta['model']}, {meta['num_prompts']} prompts x {meta['prompt_len']} + "
                 f"{meta['new_tokens']} tokens, {meta['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
