"""Host work of one pipelined decode step, against the issue's 0.3 ms at 256 running requests (CPU, no GPU needed).

A decode step of a busy engine is: schedule the next step (`Scheduler.schedule_decode_step`), fill the static decode
buffers (`ModelRunner._execute_static`), launch the forward and the picks, then apply the previous step's tokens
(`PipelinedDecode._apply`: stop conditions, finished requests, prefix-cache commits). On a GPU that Python runs while
the GPU computes the step before; when it takes longer than the GPU step, the GPU waits.

This times exactly that Python: a tiny model on the CPU, `decode_mode = "static"` (the host path of the CUDA-graph
steps), the model forward replaced by a canned logits tensor of 32 columns (the step's table gather is kept; the
pick's compute over a real vocabulary is device work on a GPU), greedy or sampled requests that never stop early,
`--steps` steps after the prompts are in. With `--finishing` the requests stop at ShareGPT-like lengths and every step
until the last one finishes is timed (the batch shrinks; the per-request column divides by the starting count). With
`--sampled` the sampling kernel is stood in for by an argmax (the CPU's reference sampler does real work that the
GPU's kernel does on the device); the parameters' preparation on the host and their upload stay. It does not count
the CUDA-specific costs of a GPU step
(graph launch ~0.3 ms for ~260 kernels, copies, event waits), nor the forward itself.

With `--grouped` the model is a tiny Gemma 3 of Gemma-3-1B's 26 layers (five sliding-window layers to one global),
whose engine keeps a block table per layer group, seven of them (`release_window_blocks`, `runner.group_static`):
the host work of a grouped step.

Prints a markdown table (running requests, host ms per step, the goal and its fraction) and writes
``host_step.json`` and ``host_step.png`` under ``--out``.

    PYTHONPATH=. python benchmarks/bench_host_step.py --out /tmp/bench [--sampled]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged.kernels import sampling as kernel_sampling  # noqa: E402
from hf_paged.model_zoo import tiny_model as zoo_model  # noqa: E402
from hf_paged.testing import tiny_model  # noqa: E402

GOAL_MS = 0.3  # issue 16: per-step host work at 256 running requests
CANNED_COLUMNS = 32
FINISHING_MAX = 1024  # the longest output of `--finishing`


class _ArgmaxKernel:
    @staticmethod
    def sample_tokens(logits, *args):
        return logits.argmax(dim=-1)


def tiny_grouped_model():
    """A tiny Gemma 3 with Gemma-3-1B's layer pattern (26 layers, five sliding-window layers of 512 to one global):
    seven layer groups in the engine, as the real model has (the forward is canned: the layers' count only decides
    the groups)."""
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    return zoo_model("gemma3_text", seed=1, num_hidden_layers=26, layer_types=types, sliding_window=512,
                     max_position_embeddings=8192)


def host_ms_per_step(running: int, steps: int, sampled: bool, prefix_caching: bool, seed: int = 0,
                     finishing: bool = False, grouped: bool = False) -> float:
    """Mean wall time of `steps` pipelined decode steps with `running` requests, the forward canned. `finishing`:
    the requests stop at ShareGPT-like lengths instead (lognormal, mean ~300 tokens, clipped to [4, 1024]), and every
    step until the last one finishes is timed: the batch shrinks, and the engine reschedules around each finish."""
    model = tiny_grouped_model() if grouped else tiny_model("llama", seed=1, num_hidden_layers=1,
                                                                max_position_embeddings=8192)
    longest = FINISHING_MAX if finishing else steps + 10
    engine = hf_paged.Engine(model, block_size=16, max_num_seqs=max(running, 1), max_num_batched_tokens=16384,
                             num_blocks=running * (longest + 70) // 16 + 64, enable_prefix_caching=prefix_caching)
    runner = engine.runner
    runner.decode_mode = "static"
    if runner.grouped != grouped:
        raise RuntimeError(f"the engine {'does not group' if grouped else 'groups'} its layers")
    # 32 columns: on a GPU the argmax / sampling kernel over the vocabulary is device work, only its launch is host
    # work; a full-width row here would time the CPU's argmax instead (85 us at 256 x 384)
    canned = torch.randn(max(running, 1), CANNED_COLUMNS)

    def forward(batch: int) -> torch.Tensor:  # what the graph replays, less the model: the table gather stays
        b = runner._buffers
        torch.index_select(b["store"], 0, b["rows"][:batch], out=b["tables"][:batch])
        return canned[:batch]

    runner._run_model = forward
    rng = random.Random(seed)
    kwargs = dict(do_sample=True, temperature=0.7, top_p=0.9) if sampled else {}
    for _ in range(running):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(20, 60))]  # (the zoo's vocabulary: 256)
        length = min(FINISHING_MAX, max(4, int(rng.lognormvariate(5.4, 0.8)))) if finishing else steps + 10
        engine.add_request(prompt, max_new_tokens=length, ignore_eos=True, **kwargs)
    saved = kernel_sampling._triton_module, kernel_sampling.get_backend
    if sampled:  # the dispatcher's tensor ops run; the kernel is an argmax (see the module docstring)
        kernel_sampling._triton_module = lambda name: _ArgmaxKernel
        kernel_sampling.get_backend = lambda device: "triton"
    try:
        for _ in range(5):  # prompts in, pipeline filled
            engine.step(finished_only=True)
        gc.collect()  # the garbage of earlier runs in this process (engines, their prefix caches) is not this run's
        start = time.perf_counter()
        if finishing:
            steps = 0
            while engine.has_unfinished():
                engine.step(finished_only=True)
                steps += 1
        else:
            for _ in range(steps):
                engine.step(finished_only=True)
        elapsed = time.perf_counter() - start
    finally:
        kernel_sampling._triton_module, kernel_sampling.get_backend = saved
    pipelined = engine.pipelined_steps
    engine.close()
    if pipelined < steps * (0.9 if finishing else 1):  # (the pipeline drains at the end)
        raise RuntimeError(f"only {pipelined} of {steps} steps were pipelined")
    return 1000 * elapsed / steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="1,8,32,64,128,256", help="comma list of running-request counts")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sampled", action="store_true", help="temperature 0.7 / top-p 0.9 requests (else greedy)")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--finishing", action="store_true",
                        help="requests stop at ShareGPT-like lengths; every step until the last finishes is timed")
    parser.add_argument("--grouped", action="store_true",
                        help="a tiny Gemma 3 (a sliding and a global layer): one block table per layer group")
    parser.add_argument("--out", default="benchmarks/results")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    rows = []
    print(f"| running | host ms / step | µs per request | goal at 256 ({GOAL_MS} ms) / measured |")
    print("|---|---|---|---|")
    for running in (int(r) for r in args.running.split(",")):
        ms = host_ms_per_step(running, args.steps, args.sampled, args.prefix_caching, finishing=args.finishing,
                              grouped=args.grouped)
        fraction = f"{GOAL_MS / ms:.0%}" if running == 256 else "-"
        print(f"| {running} | {ms:.3f} | {1000 * ms / running:.1f} | {fraction} |", flush=True)
        rows.append({"running": running, "host_ms": ms})
    meta = {"sampled": args.sampled, "prefix_caching": args.prefix_caching, "steps": args.steps,
            "finishing": args.finishing, "grouped": args.grouped,
            "torch": torch.__version__, "goal_ms_at_256": GOAL_MS}
    with open(os.path.join(args.out, "host_step.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["running"] for r in rows], [r["host_ms"] for r in rows], "o-", label="hf_paged host work per step")
    ax.axhline(GOAL_MS, color="#c33", linestyle="--", label=f"goal at 256: {GOAL_MS} ms")
    ax.set_xlabel("running requests")
    ax.set_ylabel("ms per decode step (CPU, forward canned)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "host_step.png"), dpi=120)


if __name__ == "__main__":
    main()
