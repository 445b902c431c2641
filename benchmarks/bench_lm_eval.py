"""lm-eval `generate_until` throughput: lm-evaluation-harness' `hf` backend vs the same with hf-paged (issue 17).

lm-eval 0.4's `hf` backend (`HFLM.generate_until`) sorts a task's requests by length, cuts them into fixed batches of
`--batch-size`, left-pads each batch and calls, per batch,
``model.generate(input_ids=context, max_length=len + max_gen_toks, stopping_criteria=<until strings>,
pad_token_id=..., use_cache=True, do_sample=False)`` (no attention mask: transformers infers it from the padding).
A batch runs until its longest row stops. This script makes those calls itself, so it needs no lm_eval install and no
task data (the GPU machine has neither); the CPU test `tests/test_lm_eval.py` runs the real harness on both backends.

Systems, on the same random llama-1b-shaped model (bf16, SmolLM2's tokenizer so stop strings are real text):
  hf             the `hf` backend's batches on transformers (DynamicCache)
  hf+paged       the same batches with ``cache_implementation="paged"`` (the one-argument change, `gen_kwargs`)
  hf-paged       the `hf-paged` backend: every request in one continuous-batching run (`Engine.generate`, per-request
                 stop strings and `max_gen_toks`)
Prints a table (seconds, output tokens/s, speed-up vs hf, greedy rows equal to hf, the decode bound and the fraction
reached) and writes lm_eval.json / lm_eval.png under --out.

`--kv-cache-dtype fp8` runs the hf_paged systems on an FP8 KV pool (their texts then differ from `hf`'s by the
quantisation; `benchmarks/bench_kv_fp8_accuracy.py` measures the accuracy, with lm-eval task scores).

    python benchmarks/bench_lm_eval.py --tokenizer .wheels/smollm2-tokenizer --requests 400 --out results/
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, StoppingCriteria, StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_generate import SHAPES, build_model  # noqa: E402
from roofline import copy_bandwidth, decode_bound_s, model_bytes  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.engine import SamplingParams  # noqa: E402
from hf_paged.integrations.generate import get_engine  # noqa: E402

UNTIL = ["\n\n", "Question:"]


class StopStrings(StoppingCriteria):
    """lm-eval's multi-token stop rule: a row is done once one of `until` appears in the text it generated."""

    def __init__(self, tokenizer, until: list[str], prompt_len: int) -> None:
        self.tokenizer, self.until, self.prompt_len = tokenizer, until, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:][:, -16:])
        return torch.tensor([any(u in t for u in self.until) for t in texts], device=input_ids.device)


def cut(text: str) -> str:
    """lm-eval's post-processing: the generation up to the first stop string."""
    for u in UNTIL:
        text = text.split(u)[0]
    return text


def build(args, vocab: int, device: str):
    """The model of `args.model`'s shape with the tokenizer's vocabulary, seeded: every system gets the same weights."""
    torch.manual_seed(0)
    return build_model(args.model, device, getattr(torch, args.dtype), vocab_size=vocab)


def make_requests(n: int, lo: int, hi: int, vocab: int, pad: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    rows = []
    for k in lengths:
        ids = torch.randint(3, vocab, (k,), generator=g)
        rows.append(torch.where(ids == pad, ids + 1, ids).tolist())  # the inferred mask must see no pad inside
    return rows


def run_hf_batches(model, tokenizer, requests, args, paged: bool) -> list[list[int]]:
    """The `hf` backend's calls: longest first, fixed batches, left-padded, no attention mask."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i]))
    pad = tokenizer.pad_token_id
    out: list[list[int] | None] = [None] * len(requests)
    extra = {"cache_implementation": "paged"} if paged else {}
    for b in range(0, len(order), args.batch_size):
        idx = order[b: b + args.batch_size]
        width = max(len(requests[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, width - len(requests[i]):] = torch.tensor(requests[i])
        ids = ids.to(model.device)
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, max_length=width + args.max_gen_toks, do_sample=False,
                                  stopping_criteria=StoppingCriteriaList([StopStrings(tokenizer, UNTIL, width)]),
                                  pad_token_id=pad, use_cache=True, **extra)
        for row, i in enumerate(idx):
            out[i] = seqs[row, width:].tolist()
    return out


def run_engine(model, tokenizer, requests, args) -> list[list[int]]:
    """The `hf-paged` backend: all requests in one continuous-batching run."""
    engine = get_engine(model, tokenizer=tokenizer)
    params = SamplingParams(max_new_tokens=args.max_gen_toks, do_sample=False, stop_strings=tuple(UNTIL))
    return [list(r.outputs[0].token_ids) for r in engine.generate(requests, params, use_tqdm=False)]


def float32_agreement(args, tokenizer, requests, vocab: int, device: str) -> str:
    """hf batches vs the hf-paged engine on a float32 copy of the model: how many greedy texts are equal."""
    small = argparse.Namespace(**{**vars(args), "dtype": "float32", "max_gen_toks": 32})
    model = build(small, vocab, device)
    ref = run_hf_batches(model, tokenizer, requests, small, paged=False)
    hf_paged.enable(model, kv_cache_memory=args.kv_cache_memory)
    got = run_engine(model, tokenizer, requests, small)
    same = sum(cut(tokenizer.decode(a)) == cut(tokenizer.decode(b)) for a, b in zip(got, ref))
    return f"{same}/{len(requests)}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--tokenizer", required=True, help="a saved tokenizer directory (SmolLM2's on the GPU)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--prompt-len", default="64,768", help="min,max context tokens")
    parser.add_argument("--max-gen-toks", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64, help="lm-eval's --batch_size for the hf backend")
    parser.add_argument("--systems", default="hf-paged,hf+paged,hf")
    parser.add_argument("--kv-cache-memory", default="20GiB")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                        help="the hf_paged systems' KV cache (fp8: an FP8 pool)")
    parser.add_argument("--agreement", type=int, default=48,
                        help="then this many requests (32 new tokens) in float32: hf vs hf-paged greedy texts; "
                             "bf16 greedy on a random model flips on rounding, float32 shows whether they agree")
    parser.add_argument("--out", default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    vocab = len(tokenizer)
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    requests = make_requests(args.requests, lo, hi, vocab, tokenizer.pad_token_id, seed=0)
    model = build(args, vocab, device)
    results: dict[str, dict] = {}
    for system in [s for s in args.systems.split(",") if s]:
        if system in ("hf-paged", "hf+paged"):
            hf_paged.enable(model, kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype)
        else:
            hf_paged.disable(model)
        runner = (lambda r: run_engine(model, tokenizer, r, args)) if system == "hf-paged" else (
            lambda r, paged=system == "hf+paged": run_hf_batches(model, tokenizer, r, args, paged))
        try:
            runner(requests[:8])  # warm-up: engine start, kernels
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outputs = runner(requests)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        except Exception as error:  # one failing system must not lose the others' figures
            results[system] = {"error": f"{type(error).__name__}: {error}"}
            print(system, results[system], flush=True)
            continue
        texts = [cut(tokenizer.decode(o)) for o in outputs]
        kept = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]
        results[system] = {"seconds": seconds, "generated_tokens": sum(len(o) for o in outputs),
                           "kept_tokens": sum(kept), "texts": texts, "kept": kept}
        print(system, f"{seconds:.2f} s", flush=True)
    bound = None
    if device == "cuda":
        ref = next((r for r in results.values() if "kept" in r), None)
        if ref is not None:  # the least any engine needs to decode what the requests keep
            work = [(p, max(1, k)) for p, k in zip(requests, ref["kept"])]
            kv = hf_paged.cache.kv_bytes_per_token(model.config, getattr(torch, args.dtype))
            bound = decode_bound_s(work, model_bytes(model), kv, copy_bandwidth())
    base = results.get("hf", {}).get("seconds")
    ref_texts = results.get("hf", {}).get("texts")
    print(f"\n{args.requests} generate_until requests, contexts {lo}-{hi} tokens, max_gen_toks {args.max_gen_toks}, "
          f"until {UNTIL!r}, hf batch size {args.batch_size}, {args.model} {args.dtype} on {device}")
    print("| system | seconds | kept tokens/s | x hf | texts == hf | bound s | bound / run |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | error: {r['error'][:80]} | | | | | |")
            continue
        same = f"{sum(a == b for a, b in zip(r['texts'], ref_texts))}/{len(ref_texts)}" if ref_texts else ""
        r["texts_equal_hf"] = same
        x = f"{base / r['seconds']:.2f}" if base else ""
        frac = f"{bound / r['seconds']:.0%}" if bound else ""
        print(f"| {name} | {r['seconds']:.2f} | {r['kept_tokens'] / r['seconds']:.0f} | {x} | {same} | "
              f"{bound or float('nan'):.2f} | {frac} |")
    agreement = None
    if args.agreement:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        agreement = float32_agreement(args, tokenizer, requests[: args.agreement], vocab, device)
        print(f"float32 greedy, {args.agreement} requests x 32 tokens: hf-paged texts == hf {agreement}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        slim = {k: {kk: vv for kk, vv in v.items() if kk not in ("texts", "kept")} for k, v in results.items()}
        (out / "lm_eval.json").write_text(json.dumps({"args": vars(args), "bound_s": bound,
                                                      "float32_agreement": agreement, "results": slim},
                                                     indent=2))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib missing: no plot")
            return
        ok = {k: v for k, v in slim.items() if "error" not in v}
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(list(ok), [v["seconds"] for v in ok.values()])
        if bound:
            ax.axhline(bound, color="k", linestyle="--", label="decode bound")
            ax.legend()
        ax.set_ylabel("seconds for the task")
        ax.set_title(f"lm-eval generate_until, {args.requests} requests, {args.model}")
        fig.tight_layout()
        fig.savefig(out / "lm_eval.png", dpi=120)


if __name__ == "__main__":
    main()
