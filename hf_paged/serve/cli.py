"""`hf-paged serve MODEL`: load a model (a local directory, a Hub id such as `Qwen/Qwen3-0.6B` through `from_pretrained`
and the local Hugging Face cache, or a GGUF file), build the engine, serve it.

`--data-parallel-size N` serves N replicas, one engine process per GPU (`cuda:0` ... `cuda:N-1`, or N CPU
replicas with `--device cpu`) behind this process's HTTP front (`hf_paged.serve.router`); `--engine-process` (the
default on CUDA: `engine_process`) runs one engine that way (a replica of one), so the front's Python does not share an
interpreter lock with the engine's.

SIGINT / SIGTERM shut down cleanly: uvicorn stops accepting connections and lets in-flight requests run for
`--shutdown-grace` seconds, then the app's lifespan end aborts what is left and closes the engine (the KV pool goes
back); the process exits 0.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import os
import sys

import torch

from ..cache import KV_CACHE_DTYPES
from ..engine import Engine, default_max_num_batched_tokens
from ..integrations.gguf import load_gguf
from .app import build_app
from .replica import ReplicaSpec
from .router import ReplicaRouter
from .tools import PARSERS

__all__ = ["main", "serve_main", "parser"]

_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-paged serve", description="OpenAI-compatible server on hf-paged's engine")
    p.add_argument("model", help="a Hub model id (ORG/NAME: from the local Hugging Face cache, or downloaded unless "
                                 "HF_HUB_OFFLINE=1), a local transformers model directory, or the directory / path of "
                                 "--gguf-file")
    p.add_argument("--revision", default=None, help="the Hub revision (branch, tag or commit) of a model id")
    p.add_argument("--gguf-file", default=None, help="load this GGUF file (in MODEL's directory, or a path)")
    p.add_argument("--served-model-name", default=None, help="the id clients pass as `model` (default: MODEL)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="auto",
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu ... (default: cuda if available)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("HF_PAGED_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 (default: $HF_PAGED_API_KEY)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="e.g. 2GiB (default: sized from free GPU memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="auto: the model's dtype; fp8 (= fp8_e4m3): K/V in float8_e4m3fn, twice the tokens a GiB holds, "
                        "scales from the checkpoint or calibrated on the first prompt")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 8192 on CUDA, 2048 on the CPU)")
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    p.add_argument("--admission-batch", type=int, default=None,
                   help="while requests run, admit waiting ones this many at a time (default: max-num-seqs // 8 with "
                        "CUDA graphs, else 1)")
    p.add_argument("--admission-max-wait", type=int, default=16,
                   help="steps that may leave room unused before waiting requests are admitted anyway")
    p.add_argument("--swap-space", type=float, default=0.0, help="GiB of CPU memory for swapped blocks")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on CUDA with CUDA graphs; --no-compile-decode: never)")
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--no-warm-up", action="store_true", help="skip compiling kernels / capturing graphs up front")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="record the CUDA graphs of prefill steps at start-up (about 2 s for a 1B model), so the first "
                        "requests of each prompt size do not pay for it (default: on)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--lora", action="append", default=[], type=_lora_arg, metavar="NAME=PATH",
                   help="serve the PEFT LoRA adapter in directory PATH as model NAME (repeatable); a request's `model` "
                        "picks it, the base model's name picks none")
    p.add_argument("--max-loras", type=int, default=4, help="LoRA adapters resident at once (requests of others wait)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest rank of the LoRA adapters")
    p.add_argument("--max-queue-len", type=int, default=None,
                   help="requests waiting for their first output at most; past it a request gets 429 with Retry-After "
                        "(default: no bound)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may run; past it it is aborted (its blocks freed) and answered 504 "
                        "(default: none)")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="the model's tool-call format (default: guessed from the chat template, else hermes)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template (a file, or the template itself) "
                                                         "replacing the tokenizer's")
    p.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM before they are aborted")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="serve N replicas, one engine process per GPU (cuda:0 ... cuda:N-1; N CPU replicas with "
                        "--device cpu) behind one HTTP front that routes by prefix affinity and load (default: 1)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own, as each --data-parallel-size replica runs (also with "
                        "one device): the HTTP front (tokenising, detokenising, streaming) then has the server's "
                        "process and its interpreter lock to itself, instead of sharing them with the engine's thread "
                        "(default: on CUDA; --no-engine-process: the engine in a thread of the server's process)")
    p.add_argument("--router-imbalance", type=int, default=8, metavar="K",
                   help="with --data-parallel-size: a request goes to the replica holding its prompt's prefix unless "
                        "that replica has K more requests in flight than the least loaded one (default: 8); an "
                        "X-HF-Paged-Affinity header pins whatever the load")
    p.add_argument("--log-level", default="info")
    return p


def replica_devices(args, cuda_count: int | None = None) -> list[str]:
    """The device of each replica of `--data-parallel-size`; ValueError naming the flag when they do not exist.
    `cuda_count`: the GPUs visible (default: torch's count)."""
    n = args.data_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--data-parallel-size must be a positive integer, got {n!r}")
    if args.router_imbalance < 0:
        raise ValueError(f"--router-imbalance must be >= 0, got {args.router_imbalance}")
    if n == 1:
        return [args.device or ("cuda" if torch.cuda.is_available() else "cpu")]
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    device = torch.device(args.device or ("cuda" if cuda_count else "cpu"))
    if device.type == "cpu":
        return ["cpu"] * n
    if device.type != "cuda":
        raise ValueError(f"--data-parallel-size takes --device cuda or cpu, got --device {args.device}")
    if device.index is not None:
        raise ValueError(f"--device {args.device} names one GPU; --data-parallel-size {n} uses cuda:0 ... "
                         f"cuda:{n - 1} (pick the GPUs with CUDA_VISIBLE_DEVICES)")
    if n > cuda_count:
        raise ValueError(f"--data-parallel-size {n} needs {n} GPUs (one replica each), but {cuda_count} "
                         f"{'is' if cuda_count == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES)")
    return [f"cuda:{i}" for i in range(n)]


def engine_process(args, device: str) -> bool:
    """Whether one engine runs in a process of its own (`--engine-process`). Default: on CUDA. Why: on an H200 (llama-1b
    shape, 300 streamed ShareGPT-like requests a rate) one engine in a thread of the server's process sustained 48
    requests/s and at most ~10k output tok/s, with the process at one core (the front and the engine's host work
    share one interpreter lock); in its own process 80 requests/s and 18k tok/s (benchmarks/results/h200_2026-11-29g).
    On the CPU the engine's threads would compete with the front's process for the same cores: in a thread there."""
    if args.engine_process is not None:
        return args.engine_process
    return torch.device(device).type == "cuda"


def engine_kwargs(args) -> dict:
    """The `Engine` arguments of the command line (`max_num_batched_tokens` None: the device's default)."""
    return dict(
        block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode, admission_batch=args.admission_batch,
        admission_max_wait=args.admission_max_wait, swap_space=args.swap_space, seed=args.seed,
        use_cuda_graph=False if args.no_cuda_graph else None, enable_prefix_caching=not args.no_prefix_caching,
        compile_decode=args.compile_decode, kv_cache_dtype=args.kv_cache_dtype, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
    )


def load_on(args, device: str) -> tuple[object, object]:
    """`load` on `device` (a replica's loader: `functools.partial(load_on, args)` pickles into its process)."""
    args = copy.copy(args)
    args.device = device
    return load(args)


def _lora_arg(text: str) -> tuple[str, str]:
    """`NAME=PATH` of `--lora`."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora takes NAME=PATH, got {text!r}")
    return name, path


def load(args) -> tuple[object, object]:
    """(model, tokenizer) from the command line's model arguments."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.gguf_file is not None or str(args.model).endswith(".gguf"):
        model, tokenizer = load_gguf(args.model, args.gguf_file, dtype=dtype, device=device)
    elif os.path.isdir(args.model):
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, local_files_only=True)
        model = model.to(device).eval()
    else:  # a Hub id: the local cache (HF_HUB_CACHE / HF_HOME), downloading only where the Hub may be reached
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model, revision=args.revision)
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, revision=args.revision)
        except (OSError, ValueError) as error:
            raise SystemExit(f"hf-paged serve: cannot load {args.model!r}: it is not a local directory, and "
                             f"from_pretrained found no such model on the Hub or in the local cache "
                             f"({_hub_cache()}{', offline' if _offline() else ''}): {_first_line(error)}") from None
        model = model.to(device).eval()
    if args.chat_template is not None:
        template = args.chat_template
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        tokenizer.chat_template = template
    return model, tokenizer


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def serve_main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = parser()
    args = p.parse_args(argv)
    try:
        devices = replica_devices(args)
    except ValueError as error:
        p.error(str(error))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or args.model
    if name in {lora_name for lora_name, _ in args.lora}:
        raise SystemExit(f"hf-paged serve: --lora {name}=... has the base model's name; pick another")
    if args.data_parallel_size > 1 or engine_process(args, devices[0]):
        spec = ReplicaSpec(functools.partial(load_on, args), engine_kwargs(args), warm_up=not args.no_warm_up,
                           prefill_graphs=args.prefill_graphs, log_level=args.log_level,
                           threads=max(1, len(os.sched_getaffinity(0)) // len(devices)), loras=tuple(args.lora))
        try:
            served = ReplicaRouter(spec, devices, imbalance=args.router_imbalance).start()
        except RuntimeError as error:  # a replica could not load the model: its traceback is in the message
            raise SystemExit(f"hf-paged serve: {error}") from None
        tokenizer = served.tokenizer
    else:
        model, tokenizer = load(args)
        kwargs = engine_kwargs(args)
        device = next(model.parameters()).device
        kwargs["max_num_batched_tokens"] = kwargs["max_num_batched_tokens"] or default_max_num_batched_tokens(
            device, serving=True)
        served = Engine(model, tokenizer, **kwargs)
        for lora_name, path in args.lora:  # before the warm-up: the CUDA graphs record the wrapped linears
            served.add_lora(lora_name, path)
        if not args.no_warm_up and served.device.type == "cuda":
            served.warm_up(prefill_graphs=args.prefill_graphs)
    app = build_app(served, tokenizer, model_name=name, api_key=args.api_key, shutdown_grace=args.shutdown_grace,
                    max_queue_len=args.max_queue_len, request_timeout=args.request_timeout,
                    tool_call_parser=args.tool_call_parser)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=max(1, int(args.shutdown_grace)), access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run()  # handles SIGINT/SIGTERM; returns after the lifespan shutdown closed the engine
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down cleanly
        pass
    return 0 if isinstance(served, ReplicaRouter) or served.closed else 1


_USAGE = "usage: hf-paged serve MODEL [options]   (hf-paged serve --help lists the options)"


def main(argv: list[str] | None = None) -> int:
    """The `hf-paged` console script: `hf-paged serve MODEL ...`; `hf-paged --help` prints the usage and exits 0."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    if not argv or argv[0] != "serve":
        print(_USAGE, file=sys.stderr)
        return 2
    return serve_main(argv[1:])
