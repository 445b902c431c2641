"""Every architecture hf-paged accepts, on a GPU: CUDA graphs and the compiled decode step, against eager decoding.

For each `model_type` whose verdict in docs/architectures.json is "pass" (or those named): the tiny seeded model of
`hf_paged.model_zoo` on CUDA, greedy `generate()` of a few ragged prompts through three engines: no CUDA graphs
(the reference), CUDA graphs, CUDA graphs + `compile_decode`. In float32 (the default) the tokens must be equal:
Inductor's fused kernels round bf16 differently from eager ones, so with `--dtype bfloat16` only failures count.
There are more prompts than the engines' `max_num_seqs`, with different output lengths, and each engine runs them
twice: so prompts are also admitted beside running decodes, and the compiled engine, which records each token bucket
of such ragged steps at its first repeat here (`ragged_capture_after = 0`), replays ragged steps from CUDA graphs.
Records, per architecture, the verdict (`same`, `differs`, `error`), how each graphed engine decodes after its
warm-up (`graph`, or `static` when the model's forward could not be recorded and the engine decodes without graphs),
the compiled engine's ragged steps, how many of them replayed a recording and why recording them failed (the engine
then runs them eagerly), its start-up seconds and any error; prints a table, and `--out` writes them as JSON.

Architectures are spread over `--jobs` worker processes (one GPU is enough: the models are tiny).

    python benchmarks/probe_compiled.py --jobs 10 --out results/gpu_architectures.json
    python benchmarks/probe_compiled.py llama qwen3        # these only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 500)) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def check(model_type: str, dtype_name: str = "float32") -> dict:
    """One architecture (in this process): the three engines' greedy tokens."""
    import warnings

    import torch

    import hf_paged
    from hf_paged import model_zoo

    record = {"model_type": model_type, "verdict": "error", "error": "", "startup_s": None, "modes": [],
              "ragged_steps": 0, "ragged_replays": 0, "ragged_failure": None}
    try:
        model = model_zoo.tiny_model(model_type, seed=0).to(getattr(torch, dtype_name)).cuda().eval()
        prompts = _prompts(12, model.config.get_text_config().vocab_size, seed=len(model_type))
        params = [hf_paged.SamplingParams(max_new_tokens=4 + 3 * (k % 4), ignore_eos=True) for k in range(len(prompts))]
        outputs = []
        for graphs, compiled in ((False, False), (True, False), (True, True)):
            start = time.perf_counter()
            engine = hf_paged.Engine(model, num_blocks=128, block_size=16, max_num_seqs=8, use_cuda_graph=graphs,
                                     compile_decode=compiled, enable_prefix_caching=False)
            runner = engine.runner
            runner.ragged_capture_after = 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine.warm_up()
            torch.cuda.synchronize()
            if compiled:
                record["startup_s"] = round(time.perf_counter() - start, 2)
            if graphs:
                record["modes"].append(runner.decode_mode)
            for _ in range(2):  # the second run repeats the first one's ragged steps: recorded, then replayed
                outs = engine.generate(prompts, params)
                failed = [o.error for o in outs if o.error is not None]
                if failed:
                    raise failed[0]
                outputs.append([o.outputs[0].token_ids for o in outs])
            if compiled:
                record["ragged_steps"] = runner.ragged_graph_steps
                record["ragged_replays"] = runner.ragged_graph_replays
                record["ragged_failure"] = runner.ragged_graph_failure  # then ragged steps ran eagerly (a warning)
            engine.close()
        same = all(o == outputs[0] for o in outputs[1:])
        record["verdict"] = "same" if same or dtype_name != "float32" else "differs"
    except Exception as error:  # noqa: BLE001 - a probe records every failure
        record["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return record


def accepted_types() -> list[str]:
    records = json.loads((ROOT / "docs" / "architectures.json").read_text())["architectures"]
    return [r["model_type"] for r in records if r["verdict"] == "pass"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", help="only these (default: every accepted architecture)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    types = args.model_types or accepted_types()
    if args.worker:  # print one JSON line per architecture
        for model_type in types:
            print(json.dumps(check(model_type, args.dtype)), flush=True)
        return
    shards = [types[k :: max(1, args.jobs)] for k in range(max(1, args.jobs))]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--dtype", args.dtype, *shard], stdout=subprocess.PIPE, text=True,
                              env=env) for shard in shards if shard]
    records = []
    for proc in procs:
        out, _ = proc.communicate()
        records += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    missing = set(types) - {r["model_type"] for r in records}
    records += [{"model_type": t, "verdict": "error", "error": "worker died", "startup_s": None, "modes": []}
                for t in missing]
    records.sort(key=lambda r: r["model_type"])
    print(f"{args.dtype}: graphs and graphs + compile_decode vs no graphs (greedy tokens)")
    print("| architecture | verdict | decode after warm-up (graphs / compiled) | ragged steps (replayed) "
          "| compiled start-up s | error |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['model_type']} | {r['verdict']} | {' / '.join(r.get('modes', []))} | "
              f"{r.get('ragged_steps', 0)} ({r.get('ragged_replays', 0)}) | {r['startup_s']} | "
              f"{(r['error'] or r.get('ragged_failure') or '')[:120]} |")
    counts = {v: sum(r["verdict"] == v for r in records) for v in ("same", "differs", "error")}
    counts["without graphs"] = sum("static" in r.get("modes", []) for r in records)
    counts["no ragged replay"] = sum(not r.get("ragged_replays") for r in records)
    counts["ragged recording failed"] = sum(bool(r.get("ragged_failure")) for r in records)
    print(f"\n{len(records)} architectures: " + ", ".join(f"{v} {n}" for v, n in counts.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "records": records, "counts": counts}, indent=1))


if __name__ == "__main__":
    main()
