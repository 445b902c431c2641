"""Start-up cost of the engine: construction + `warm_up()`, cold and warm, eager and `compile_decode`.

"Cold" is a fresh process with empty Inductor / Triton / AOTAutograd caches (their directories point at a new
temporary folder); "warm" is a later fresh process reusing those folders, which is what a user restarting a
script or a server pays (`--warm-runs` of them: one warm start spread by ±1 s between runs on the H100 hosts, so the
table gives their median and range). Each measurement runs in its own subprocess, so nothing is shared in memory
between them.

Python's own bytecode caches are primed in both (`--bytecode primed`, the default): `pip install` byte-compiles what
it installs, so a user's first start does not compile sources to bytecode, while a host that does not write bytecode
(a read-only site-packages, `PYTHONDONTWRITEBYTECODE=1`: the device machines of `/work/.library/device` are such
hosts) compiles every module Inductor imports while compiling (networkx, jinja2, ...) in every process. So the
children write and read their bytecode under one `PYTHONPYCACHEPREFIX` folder, and a first, unreported child (its own
empty compile caches) imports everything an engine's start-up imports; a measurement then no longer depends on what
the host byte-compiled beforehand. `--bytecode as-is` keeps the environment's own settings and skips that child.

What is timed (one figure per phase, seconds): building the `Engine` (memory profiling, pool allocation), then
`warm_up()` (prefill kernel JIT, Dynamo tracing + Inductor compilation of the decode step when `compile_decode`, CUDA
graph capture of every batch bucket). The model's own construction and weight initialisation are not included.

    python benchmarks/bench_startup.py --models llama-1b,qwen3-0.6b --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure_once(model_name: str, compile_decode: bool, max_num_seqs: int, kv_cache_memory: str) -> dict:
    """Run in the child process: build the model, then time the engine's construction and warm-up."""
    import torch

    sys.path.insert(0, str(HERE))
    import bench_generate

    import hf_paged

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = bench_generate.build_model(model_name, device, dtype)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine = hf_paged.Engine(model, max_num_seqs=max_num_seqs,
                             kv_cache_memory=None if kv_cache_memory == "auto" else kv_cache_memory,
                             compile_decode=compile_decode)
    t1 = time.perf_counter()
    engine.warm_up()
    if device == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    # one real request, so a start-up that deferred work to the first step would show here
    engine.generate([[1, 2, 3, 4]], hf_paged.SamplingParams(max_new_tokens=4, ignore_eos=True))
    if device == "cuda":
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    row = {"construct_s": t1 - t0, "warm_up_s": t2 - t1, "first_request_s": t3 - t2, "total_s": t3 - t0,
           "warm_up_phases_s": dict(engine.warm_up_seconds)}
    engine.close()
    if compile_decode:  # Dynamo's own split: tracing, AOT autograd, Inductor (cache hits make the warm start)
        try:
            from torch._dynamo.utils import compile_times

            row["dynamo_compile_times"] = compile_times(repr="str", aggregate=True)
        except Exception as exc:  # a private API: its absence must not lose the measurement
            row["dynamo_compile_times"] = f"unavailable: {exc}"
    return row


def run_child(model_name: str, compile_decode: bool, cache_dir: str, args, pycache: str | None = None) -> dict:
    """One measurement in a fresh interpreter whose compile caches live under `cache_dir`, writing and reading Python
    bytecode under `pycache` when given (see the module docstring)."""
    env = dict(os.environ)
    env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    cmd = [sys.executable, __file__, "--child", model_name, "--max-num-seqs", str(args.max_num_seqs),
           "--kv-cache-memory", args.kv_cache_memory] + (["--compile-decode"] if compile_decode else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({model_name}, compile={compile_decode}):\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_wall_s"] = wall
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama-1b,qwen3-0.6b")
    parser.add_argument("--modes", default="eager,compiled", help="eager and/or compiled (compile_decode=True)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory", default="8GiB",
                        help="the KV pool's size; 'auto': sized by the engine's memory profiling, as by default in "
                             "hf_paged (a forward at the full token budget: construction then takes a few tenths of "
                             "a second, which the hashing of Triton's compiler key overlaps)")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--warm-runs", type=int, default=3,
                        help="warm starts measured (each a fresh process); the table gives their median and range")
    parser.add_argument("--bytecode", choices=("primed", "as-is"), default="primed",
                        help="primed: Python's bytecode caches filled by an unreported first child (as after "
                             "`pip install`); as-is: the environment's own")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compile-decode", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warm_runs < 1:
        parser.error(f"--warm-runs must be at least 1, got {args.warm_runs}")
    if args.child:
        row = measure_once(args.child, args.compile_decode, args.max_num_seqs, args.kv_cache_memory)
        print(json.dumps(row))
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="hf_paged_pycache_") as pycache_dir:
        pycache = pycache_dir if args.bytecode == "primed" else None
        for model_name in args.models.split(","):
            if pycache is not None:  # imports every module a start-up needs (compiled mode imports the most)
                with tempfile.TemporaryDirectory(prefix="hf_paged_startup_prime_") as cache_dir:
                    prime = run_child(model_name, "compiled" in args.modes.split(","), cache_dir, args, pycache)
                print(f"{model_name:12s} bytecode primed (unreported run: {prime['total_s']:.1f} s)", flush=True)
            for mode in args.modes.split(","):
                rows.extend(measure_mode(model_name, mode, args, pycache))
    report(rows, args)


def measure_mode(model_name: str, mode: str, args, pycache: str | None) -> list[dict]:
    """The cold start and the `--warm-runs` warm starts of one model and mode, in fresh compile caches."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf_paged_startup_") as cache_dir:
        for state in ("cold",) + ("warm",) * args.warm_runs:
            row = run_child(model_name, mode == "compiled", cache_dir, args, pycache)
            row.update(model=model_name, mode=mode, state=state, bytecode=args.bytecode)
            rows.append(row)
            print(f"{model_name:12s} {mode:9s} {state:5s} construct {row['construct_s']:6.2f} s  "
                  f"warm_up {row['warm_up_s']:6.2f} s  first request {row['first_request_s']:5.2f} s  "
                  f"engine total {row['total_s']:6.2f} s  (process {row['process_wall_s']:6.1f} s)", flush=True)
            phases = "  ".join(f"{k} {v:.2f}" for k, v in row["warm_up_phases_s"].items())
            print(f"    warm_up phases (s): {phases}", flush=True)
            if "dynamo_compile_times" in row:
                print("    " + str(row["dynamo_compile_times"]).replace("\n", "\n    "), flush=True)
    return rows


def report(rows: list[dict], args) -> None:
    """The table, the JSON and the plot."""
    goals = {"cold": 20.0, "warm": 5.0}
    print("\n| model | mode | cold total s | warm total s (median, range) | goal (1B, compiled) |")
    print("|---|---|---|---|---|")
    for model_name in args.models.split(","):
        for mode in args.modes.split(","):
            cold = next(r for r in rows if r["model"] == model_name and r["mode"] == mode and r["state"] == "cold")
            warm = sorted(r["total_s"] for r in rows
                          if r["model"] == model_name and r["mode"] == mode and r["state"] == "warm")
            goal = f"<= {goals['cold']:.0f} cold / <= {goals['warm']:.0f} warm" if mode == "compiled" else "-"
            print(f"| {model_name} | {mode} | {cold['total_s']:.1f} | {statistics.median(warm):.1f} "
                  f"({warm[0]:.1f}-{warm[-1]:.1f}) | {goal} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "startup.json").write_text(json.dumps(rows, indent=1))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        labels = [f"{r['model']}\n{r['mode']} {r['state']}" for r in rows]
        fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.1), 4))
        bottom = [0.0] * len(rows)
        for key in ("construct_s", "warm_up_s", "first_request_s"):
            vals = [r[key] for r in rows]
            ax.bar(labels, vals, bottom=bottom, label=key[:-2])
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.axhline(goals["cold"], ls="--", c="gray", lw=0.8)
        ax.axhline(goals["warm"], ls=":", c="gray", lw=0.8)
        ax.set_ylabel("seconds")
        ax.set_title("hf_paged engine start-up (cold / warm compile caches)")
        ax.legend()
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        fig.savefig(out / "startup.png", dpi=120)


if __name__ == "__main__":
    main()
