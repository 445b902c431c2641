"""GRPO rollout time per step as TRL's GRPOTrainer produces it without vLLM: P prompts, each repeated G times
(`num_generations`), N new tokens, greedy, with an in-place weight update between steps (as the optimizer does).

Systems (the calls TRL makes, on the same model and the same sequence of weights):
  paged          `hf_paged.enable(model)`; `model.generate(input_ids, attention_mask, generation_config=...)` with
                 `cache_implementation="paged"` (`GRPOConfig(cache_implementation="paged")`)
  dynamic        the same call on the plain model (transformers, DynamicCache): TRL's default
  generate_batch `model.generate_batch(prompt_ids, generation_config=...)`: `use_transformers_continuous_batching=True`

Self-contained: a llama-1b-shaped random model (benchmarks/bench_generate.SHAPES), random prompts; no downloads.
Prints a table (seconds per rollout step, tokens/s, speed-up vs dynamic and vs generate_batch, greedy agreement with
dynamic) and writes grpo_rollouts.json and grpo_rollouts.png under --out.

    python benchmarks/bench_grpo_rollouts.py --prompts 64 --generations 8 --new-tokens 256 --steps 3 --out results/
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_generate import build_model  # noqa: E402
from roofline import copy_bandwidth, decode_bound_s, expert_weights, kv_read_groups, model_bytes  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

import hf_paged  # noqa: E402


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def left_pad(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def optimizer_step(model, step: int) -> None:
    """A deterministic in-place change of every weight (what an optimizer step does to the rollout model)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 - 1e-3 * (1 + step % 2))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def rollout(system: str, model, rows, new_tokens: int):
    """One rollout step: the completions (lists of ids, one per row)."""
    if system == "generate_batch":
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        out = model.generate_batch(rows, generation_config=config, progress_bar=False)
        return [list(o.generated_tokens) for o in out.values()]
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                              cache_implementation="paged" if system == "paged" else None, disable_compile=True)
    ids, mask = left_pad(rows, model.device)
    with torch.no_grad():
        seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return seqs[:, ids.shape[1]:].tolist()


def run_system(system: str, args, prompts, device) -> dict:
    torch.manual_seed(0)  # every system gets the same random weights
    model = build_model(args.model, device, getattr(torch, args.dtype))
    if system == "paged":
        hf_paged.enable(model, kv_cache_memory=args.kv_cache_memory)
    rows = [p for p in prompts for _ in range(args.generations)]
    times, outputs = [], []
    rollout(system, model, rows[: 2 * args.generations], 4)  # warm-up (engine start, kernels, caches)
    for step in range(args.steps):
        optimizer_step(model, step)
        sync(device)
        start = time.perf_counter()
        outputs.append(rollout(system, model, rows, args.new_tokens))
        sync(device)
        times.append(time.perf_counter() - start)
    extra = {}
    if system == "paged":
        engine = model._hf_paged_engine
        extra["prefix_hit_tokens"] = engine.prefix_cache_stats().hit_tokens
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    tokens = len(rows) * args.new_tokens
    return {"system": system, "step_s": times, "mean_step_s": sum(times) / len(times),
            "tokens_per_s": tokens / (sum(times) / len(times)), "outputs": outputs, **extra}


def float32_agreement(args, prompts, device) -> str:
    """TRL's call with hf-paged vs on the plain model, on a float32 copy (bf16 greedy on a random model flips on
    rounding): 8 prompts x `generations` rows, 32 new tokens, a rollout, an optimizer step, then the compared rollout
    (so K/V cached under the old weights would show). How many rows are equal."""
    rows = [p for p in prompts[:8] for _ in range(args.generations)]
    torch.manual_seed(0)
    model = build_model(args.model, device, torch.float32)
    hf_paged.enable(model, kv_cache_memory=args.kv_cache_memory)
    rollout("paged", model, rows, 32)
    optimizer_step(model, 0)
    got = rollout("paged", model, rows, 32)
    hf_paged.disable(model)
    ref = rollout("dynamic", model, rows, 32)
    del model
    return f"{sum(a == b for a, b in zip(got, ref))}/{len(rows)}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", default="64,256", help="min,max prompt length")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--systems", default="paged,dynamic,generate_batch")
    parser.add_argument("--kv-cache-memory", default="20GiB")
    parser.add_argument("--agreement", type=int, default=1, help="1: also compare greedy rows in float32")
    parser.add_argument("--out", default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    vocab = build_model(args.model, "meta", torch.float32).config.vocab_size
    prompts = make_prompts(args.prompts, lo, hi, vocab, seed=0)
    results = {}
    for system in [s for s in args.systems.split(",") if s]:
        try:
            results[system] = run_system(system, args, prompts, device)
        except Exception as error:  # one failing system must not lose the others' figures
            results[system] = {"system": system, "error": f"{type(error).__name__}: {error}"}
        print(system, {k: v for k, v in results[system].items() if k != "outputs"}, flush=True)
    ref = results.get("dynamic", {}).get("outputs")
    agreement = None
    if args.agreement:
        agreement = float32_agreement(args, prompts, device)
        print(f"float32 greedy after an optimizer step: paged rows == dynamic {agreement}")
    bound = None
    if device == "cuda":  # the least one rollout step can take: weights + every row's KV read per decode step
        meta = build_model(args.model, "meta", getattr(torch, args.dtype))
        rows = [(p, args.new_tokens) for p in prompts for _ in range(args.generations)]
        kv = hf_paged.cache.kv_bytes_per_token(meta.config, getattr(torch, args.dtype))
        weights = model_bytes(meta)
        bound = decode_bound_s(rows, weights, kv_read_groups(meta.config, kv), copy_bandwidth(),
                               experts=expert_weights(meta))
        print(f"decode bound per rollout step: {bound:.2f} s")
    print(f"\n{args.prompts} prompts x {args.generations} generations x {args.new_tokens} tokens, {args.model} "
          f"{args.dtype} on {device}")
    print("| system | s / rollout step | tokens/s | x dynamic | x generate_batch | rows == dynamic | bound / run |")
    print("|---|---|---|---|---|---|---|")
    base = results.get("dynamic", {}).get("mean_step_s")
    cb = results.get("generate_batch", {}).get("mean_step_s")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | error: {r['error'][:80]} | | | | | |")
            continue
        same = ""
        if ref is not None:
            pairs = [(a, b) for s, t in zip(r["outputs"], ref) for a, b in zip(s, t)]
            same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            r["rows_equal_dynamic"] = same
        x_base = f"{base / r['mean_step_s']:.2f}" if base else ""
        x_cb = f"{cb / r['mean_step_s']:.2f}" if cb else ""
        frac = f"{bound / r['mean_step_s']:.0%}" if bound else ""
        print(f"| {name} | {r['mean_step_s']:.2f} | {r['tokens_per_s']:.0f} | {x_base} | {x_cb} | {same} | {frac} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        slim = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()}
        (out / "grpo_rollouts.json").write_text(json.dumps({"args": vars(args), "bound_s": bound, "float32_agreement": agreement,
                                                            "results": slim}, indent=2))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            ok = {k: v for k, v in slim.items() if "error" not in v}
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.bar(list(ok), [v["mean_step_s"] for v in ok.values()])
            ax.set_ylabel("seconds per rollout step")
            ax.set_title(f"GRPO rollouts: {args.prompts}x{args.generations}x{args.new_tokens}, {args.model}")
            fig.tight_layout()
            fig.savefig(out / "grpo_rollouts.png", dpi=120)
        except ImportError:
            print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
