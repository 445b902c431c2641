"""KV memory saved by block sharing: parallel sampling and beam search (PagedAttention paper §6.3, Fig. 15).

An Alpaca-like workload (lognormal lengths, sigma 1, input mean 19 / output mean 58 tokens, seeded; the generator of
`bench_generate.py`) runs through one engine per setting: parallel sampling with n = 2, 4, 6 samples and beam search
with width 2, 4, 6. EOS is ignored, so every sample / beam runs its request's full output length. At every engine
step, right after scheduling (the blocks that step's forward holds, copy-on-write copies included), the engine
records the KV blocks actually used and the blocks the same sequences would use without sharing (the sum of their
block-table lengths); the table reports the saving `1 - used / without` of the time-averaged block counts, the mean
of the per-step savings, and the peaks. Memory saving is a block count, not a speed, so a tiny random model on the CPU
measures it as well as a GPU would; `--model smollm2` uses the real SmolLM2-135M-Instruct instead.

    python benchmarks/bench_sharing.py                      # tiny random llama (vocab 384), 200 requests
    python benchmarks/bench_sharing.py --model tiny-32k     # random llama with a 32k vocabulary
    python benchmarks/bench_sharing.py --model smollm2 --num-requests 48
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_generate import SHAPES, make_workload  # noqa: E402

import hf_paged  # noqa: E402

ENGINE_ARGS = set(inspect.signature(hf_paged.Engine).parameters)
PAPER = {("parallel", 2): 6.1, ("parallel", 4): 8.5, ("parallel", 6): 9.8,
         ("beam", 2): 37.6, ("beam", 4): 53.1, ("beam", 6): 55.2}


def build_model(name: str, device: str):
    if name == "tiny":
        from hf_paged.testing import tiny_model

        return tiny_model("llama", seed=0).to(device)
    if name == "smollm2":
        from hf_paged.testing import load_smollm2

        return load_smollm2()[0].to(device)
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[name.removesuffix("-32k")] if name.endswith("-32k") else SHAPES[name])
    model_type = shape.pop("model_type", "llama")
    config = AutoConfig.for_model(model_type, max_position_embeddings=4096, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval().to(device)


def workload_for(model, n: int, seed: int):
    """(prompt ids, output length) pairs; token ids folded into the model's vocabulary, lengths into its positions."""
    vocab = model.config.vocab_size
    max_pos = getattr(model.config, "max_position_embeddings", 4096)
    rows = []
    for prompt, out_len in make_workload("alpaca", n, seed, max_len=1024):
        prompt = [3 + t % (vocab - 3) for t in prompt][: max_pos // 2]
        rows.append((prompt, max(1, min(out_len, max_pos - len(prompt)))))
    return rows


def run(model, workload, mode: str, width: int, args) -> dict:
    bs = args.block_size
    need = sum(-(-(len(p) + o) // bs) * width for p, o in workload)
    # prefix caching (sharing across requests) off: only the sharing inside a request's group is measured
    extra = {"enable_prefix_caching": False} if "enable_prefix_caching" in ENGINE_ARGS else {}
    engine = hf_paged.Engine(model, block_size=bs, num_blocks=min(need, args.max_blocks) + 64,
                             max_num_seqs=args.max_num_seqs, seed=args.seed, **extra)
    for i, (prompt, out_len) in enumerate(workload):
        if mode == "parallel":
            params = hf_paged.SamplingParams(max_new_tokens=out_len, do_sample=True, num_return_sequences=width,
                                             seed=args.seed + i, ignore_eos=True)
        else:
            params = hf_paged.SamplingParams(max_new_tokens=out_len, num_beams=width, ignore_eos=True)
        engine.add_request(prompt, params=params)
    series = []
    execute = engine.runner.execute

    def recording(sched):  # the same sample the engine accumulates, kept per step for the plot
        stats = engine.kv_stats()
        series.append((stats.used_blocks, stats.logical_blocks))
        return execute(sched)

    engine.runner.execute = recording
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step(finished_only=True):
            tokens += sum(len(o.token_ids) for o in out.outputs)
    wall = time.perf_counter() - start
    s = engine.sharing_stats()
    assert engine.kv_stats().used_blocks == 0
    return {
        "mode": mode, "width": width, "requests": len(workload), "steps": s.steps, "wall_s": wall,
        "preemptions": sum(engine.scheduler.num_preemptions.values()), "mean_running": engine.stats["running_sum"]
        / max(1, engine.stats["steps"]), "mean_used_blocks": s.mean_used_blocks,
        "mean_logical_blocks": s.mean_logical_blocks, "saving_pct": 100 * s.mean_saving,
        "mean_step_saving_pct": 100 * s.mean_step_saving, "peak_used_blocks": s.peak_used_blocks,
        "peak_logical_blocks": s.peak_logical_blocks, "paper_pct": PAPER[(mode, width)], "series": series,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny | tiny-32k | smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-blocks", type=int, default=1 << 20, help="cap on the KV pool (blocks)")
    parser.add_argument("--widths", default="2,4,6")
    parser.add_argument("--modes", default="parallel,beam")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    torch.set_grad_enabled(False)
    model = build_model(args.model, args.device)
    workload = workload_for(model, args.num_requests, args.seed)
    mean_in = sum(len(p) for p, _ in workload) / len(workload)
    mean_out = sum(o for _, o in workload) / len(workload)
    print(f"model {args.model}, {len(workload)} requests, mean input {mean_in:.1f} / output {mean_out:.1f} tokens, "
          f"block size {args.block_size}, max_num_seqs {args.max_num_seqs}, device {args.device}")
    rows = []
    for mode in args.modes.split(","):
        for width in (int(w) for w in args.widths.split(",")):
            row = run(model, workload, mode, width, args)
            rows.append(row)
            print(f"  {mode} {width}: {row['saving_pct']:.1f}% saved ({row['steps']} steps, {row['wall_s']:.1f} s)",
                  flush=True)

    print()
    print("| decoding | n / width | mean blocks used | mean blocks without sharing | saved (time-avg) | "
          "saved (mean of steps) | peak used | peak without sharing | paper (OPT-13B) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = "parallel sampling" if r["mode"] == "parallel" else "beam search"
        print(f"| {name} | {r['width']} | {r['mean_used_blocks']:.1f} | {r['mean_logical_blocks']:.1f} | "
              f"{r['saving_pct']:.1f} % | {r['mean_step_saving_pct']:.1f} % | {r['peak_used_blocks']} | "
              f"{r['peak_logical_blocks']} | {r['paper_pct']:.1f} % |")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"sharing_{args.model}_alpaca_{len(workload)}"
    meta = {
        "model": args.model, "num_requests": len(workload), "seed": args.seed, "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs, "mean_input": mean_in, "mean_output": mean_out,
        "torch": torch.__version__, "python": platform.python_version(), "device": args.device,
    }
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {out / f'{stem}.json'}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{'parallel' if r['mode'] == 'parallel' else 'beam'} {r['width']}" for r in rows]
    x = range(len(rows))
    bars.bar([i - 0.2 for i in x], [r["saving_pct"] for r in rows], width=0.4, label="hf_paged", color="#2a7")
    bars.bar([i + 0.2 for i in x], [r["paper_pct"] for r in rows], width=0.4, label="paper (OPT-13B)", color="#999")
    bars.set_xticks(list(x), labels, fontsize=8)
    bars.set_ylabel("KV memory saved by sharing (%)")
    bars.legend()
    for r, label in zip(rows, labels):
        saving = [100 * (1 - u / w) if w else 0 for u, w in r["series"]]
        curves.plot(saving, label=label, linewidth=1)
    curves.set_xlabel("engine step")
    curves.set_ylabel("saved (%)")
    curves.legend(fontsize=7)
    fig.suptitle(f"{args.model}, Alpaca-like, {len(workload)} requests, block size {args.block_size}")
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    print(f"wrote {out / f'{stem}.png'}")


if __name__ == "__main__":
    main()
