"""The engine's defaults that depend on the device and the step path: whether to compile the decode step, the
per-step token budget, how many sequences an admission beside running requests waits for. Measured choices, kept
apart from the step loop (`hf_paged.engine.engine`) so that each says why."""

from __future__ import annotations

import torch

from ..attention import writes_other_cache_layers

__all__ = ["compile_decode_for", "default_admission_batch", "default_compile_decode", "default_max_num_batched_tokens",
           "sparse_step_modes"]


def default_compile_decode(device: torch.device, use_cuda_graph: bool | None, compile_modules: bool) -> bool:
    """`compile_decode=None`: compile the decode step where it is measured to pay, on CUDA with CUDA graphs.

    There the compiled step is 1.4-1.5x faster (H100, one process: llama-1b greedy ShareGPT 29,921 vs 19,707 tok/s,
    Qwen3-0.6B sampled 17,047 vs 11,971) and starts in seconds (llama-1b 9.6 s cold / 3.9 s warm, Qwen3-0.6B
    11.3 / 4.4 s, against 3.1 / 1.7 s eager), and every accepted architecture compiles to the eager step's tokens
    (`benchmarks/probe_compiled.py`). Not on the CPU (not measured to pay there, and compiling takes longer than most
    CPU runs), not without CUDA graphs (`use_cuda_graph=False` is the debugging setting), not with `compile_modules`
    (not measured with it). Under tensor parallelism too: on 2 H200s (llama-8b, KV-bound workload) the compiled,
    graph-captured step decoded in 20 ms a step with 0.5 ms of host time, against 44 ms (43 ms host) for the model's
    own code, whose DTensor bookkeeping costs host time in every linear layer. An automatic compilation that fails
    falls back to the eager step with a warning (`ModelRunner.compile_auto`); with an explicit `True` the error fails
    the step's requests.
    """
    return device.type == "cuda" and use_cuda_graph is not False and not compile_modules


def compile_decode_for(model, compile_decode: bool, compile_auto: bool) -> bool:
    """`compile_decode`, unless `model` has attention that writes a cache layer other than its own `layer_idx`
    (Zamba's shared block, HRM's cycles): the compiled step's fused op writes the module's own layer, so such a model
    decodes eagerly; asked for explicitly (`compile_decode=True`), that is a ValueError naming why."""
    if not compile_decode or not writes_other_cache_layers(model):
        return compile_decode
    if not compile_auto:
        raise ValueError(f"compile_decode=True: {type(model).__name__}'s attention writes cache layers other than its "
                         "own layer_idx (cache_layer_index), which the compiled decode step does not follow; pass "
                         "compile_decode=False (or None)")
    return False


def default_max_num_batched_tokens(device: torch.device | str, serving: bool = False) -> int:
    """The per-step token budget when none is given, as vLLM chooses it: 16,384 tokens for offline use on a GPU with
    at least 70 GiB that is not an A100 (where vLLM measured larger budgets to lose throughput), 8,192 on other GPUs
    and for serving, 2,048 on the CPU.

    Why larger offline: a prefill step pays a fixed host cost per layer (the compiled layers' calls, kernel launches),
    so fewer, larger steps prefill faster (Qwen3-0.6B shape, 256 sampled requests on an H100: the run 9.99 -> 9.71 s,
    `benchmarks/results/h100_2026-11-25c/machines/`). Why not when serving: a running request's next token waits for
    the whole mixed step, so a larger budget lengthens the inter-token latency of everything beside a long prompt.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 2048
    if serving:
        return 8192
    props = torch.cuda.get_device_properties(device)
    large = props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower()
    return 16384 if large else 8192


def default_admission_batch(max_num_seqs: int, graphed: bool) -> int:
    """`admission_batch=None`: with CUDA graphs, admissions beside running requests wait for an eighth of
    `max_num_seqs` (32 of 256) to fit at once (see `Scheduler.admission_due`); otherwise 1, each as soon as it fits.

    Why only with graphs: there a decode step replays a graph and is pipelined, while a step that also prefills new
    prompts runs the layers one call at a time with the host in the loop, about ten decode steps' time whatever the
    prompts (llama-1b on an H100, 1,000 Alpaca-like requests: ~25 ms against ~2.5 ms). A saturated engine that admits
    each request as one finishes makes nearly every step such a step. Without graphs both kinds of step run the
    same eager code, and waiting would only delay the newcomers.
    """
    return max(1, max_num_seqs // 8) if graphed else 1


def sparse_step_modes(cache, use_cuda_graph: bool | None, compile_decode: bool,
                      compile_auto: bool) -> tuple[bool | None, bool]:
    """(use_cuda_graph, compile_decode) for an engine over `cache`. A sparse-attention model's (a layer with indexer
    keys) steps run eagerly: its indexer's selection is planned per sequence on the host
    (`hf_paged.attention.adapters.dsa`), which neither a CUDA graph nor the compiled decode step can replay. Asking
    for either is refused (a ValueError naming the argument); the automatic choice turns them off. Other models keep
    what they were given."""
    if not any(shape.index_dim for shape in cache.kv_shapes):
        return use_cuda_graph, compile_decode
    if use_cuda_graph:
        raise ValueError("use_cuda_graph=True is not supported for a learned-sparse-attention model (its indexer's "
                         "top-k runs eagerly, per sequence); leave use_cuda_graph unset")
    if compile_decode and not compile_auto:
        raise ValueError("compile_decode=True is not supported for a learned-sparse-attention model (its indexer's "
                         "top-k runs eagerly, per sequence); leave compile_decode unset")
    return False, False
