"""What the GPU allows on a workload: the memory-bandwidth bound of decoding, prefill FLOPs, and measured ceilings.

Used by `bench_generate.py` (and other benchmarks) to print, next to every measured time, the least time any engine
could take and the fraction of it reached.

* Decode bound: every decode step must read the weights once plus the KV of every running sequence. With every request
  running from the start (the most batching any schedule can have), step `s` (1-based) has the requests whose output
  is at least `s` tokens long, each with `prompt + s - 1` tokens of context; the bound is the sum over steps of
  (weight bytes + KV bytes of those contexts) / copy bandwidth. Prefill is left out, so the bound only gets lower.
  A sliding-window layer reads at most its window of the context; a mixture of experts reads the experts its B
  tokens are routed to (their expected number under uniform routing), not all of them.
* Decode roofline (`decode_roofline_s`): the same steps, each at least as long as its matrix FLOPs take at the
  measured matmul rate. Reported beside the bound, which stays the issue's yardstick.
* Prefill FLOPs: 2 x parameters per token for the matrices (not the embedding tables: the input one is gathered and
  the output projection runs on each prompt's last token only; a mixture of experts' routed experts at the share a
  token uses), plus the attention's `QK^T` and `PV` products over the causal context (2 x 2 x heads x head_dim per
  (query, key) pair, half the square for a causal prompt). (Until 2026-11-27 every parameter was counted for every
  token: for llama-1b that counted 1.50 B parameters per token where its matrices have 0.97 B, and the prefill MFU
  reported was too high by about that ratio.)
* Ceilings, measured once per run: a device-to-device copy (bytes read + written per second) and a bf16 matrix
  product of 8192^3, as METHOD.md asks.
"""

from __future__ import annotations

import numpy as np
import torch


def copy_bandwidth(device: str = "cuda", size_bytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes moved (read + written) per second by a large device-to-device copy; median of `repeats`."""
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * size_bytes / float(np.median(times[3:]))


def matmul_flops(device: str = "cuda", n: int = 8192, repeats: int = 10) -> float:
    """bf16 FLOP/s of an n^3 matrix product on random data; median of `repeats`."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del a, b
    return 2 * n**3 / float(np.median(times[3:]))


def _local(tensor):
    """A weight as this process holds it: a tensor-parallel model's DTensor as its local shard (a DTensor's `numel()`
    is the whole tensor's, and its `data_ptr()` is no shard's address)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _key(tensor):
    """Where a weight lives: its local shard's address (tied weights share it); on the meta device, the tensor."""
    tensor = _local(tensor)
    return id(tensor) if tensor.device.type == "meta" else tensor.data_ptr()


def _text_config(config):
    """The decoder's config (a multimodal config's text part)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _sliding_layers(text) -> tuple[int, int | None]:
    """(layers with a sliding window, the window) of a decoder config; (0, None) when none slides."""
    types = list(getattr(text, "layer_types", None) or [])
    window = getattr(text, "sliding_window", None)
    if not types or not window:
        return 0, None
    return sum(t == "sliding_attention" for t in types), int(window)


def model_bytes(model) -> int:
    """Bytes of the weights one decode forward reads in this process: every parameter once, except embedding tables
    that the forward only gathers rows of (the input token embedding of an untied model, position embeddings): a step
    of B sequences reads B of their rows, not the table. An embedding tied to the output projection counts once, since
    the lm_head reads all of it. Under tensor parallelism, this rank's shards.

    (Until 2026-11-26 the untied input embedding was counted too: for llama-1b that added 525 MB, a sixth of the
    bytes, to every step's bound, so the fractions reported for untied models were too high by about that much.)"""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    read_whole = {_key(output.weight)} if output is not None and hasattr(output, "weight") else set()
    gathered = {_key(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    seen, total = gathered - read_whole, 0
    for p in model.parameters():
        if _key(p) not in seen:
            seen.add(_key(p))
            local = _local(p)
            total += local.numel() * local.element_size()
    return total


def kv_read_groups(config, kv_bytes_per_token: int) -> list[tuple[int, int | None]]:
    """[(bytes per token of context, window)]: how much of its context each group of layers must read in a decode
    step. A sliding-window layer (`layer_types` "sliding_attention") reads at most `sliding_window` tokens; every
    other layer reads the whole context (None). `kv_bytes_per_token` is the all-layer figure, split evenly."""
    text = _text_config(config)
    sliding, window = _sliding_layers(text)
    if not sliding:
        return [(kv_bytes_per_token, None)]
    layers = len(text.layer_types)
    per_layer = kv_bytes_per_token / layers
    groups = [(round(per_layer * sliding), window), (round(per_layer * (layers - sliding)), None)]
    return [g for g in groups if g[0]]


def expert_weights(model) -> tuple[int, int, int]:
    """(bytes of the routed experts' weights, experts per layer, experts per token) of a mixture-of-experts model;
    (0, 1, 1) for a dense one. Expert weights are the parameters under a module named `experts`."""
    text = model.config.get_text_config(decoder=True)
    num = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    top = getattr(text, "num_experts_per_tok", None)
    if not num or not top:
        return 0, 1, 1
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in f".{name}":
            local = _local(p)
            total += local.numel() * local.element_size()
    return total, int(num), int(top)


def decode_step_bytes(workload: list[tuple[list[int], int]], weight_bytes: int,
                      kv_bytes_per_token: int | list[tuple[int, int | None]],
                      experts: tuple[int, int, int] = (0, 1, 1), state_bytes: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(bytes each decode step must read, rows it runs) of `workload` [(prompt ids, output length)], every request
    running from the start (see the module docstring).

    `kv_bytes_per_token` is one all-layer figure or `kv_read_groups`' [(bytes per token, window)]. `experts` is
    `expert_weights`' (bytes, experts, experts per token): a step of B tokens reads, with tokens routed uniformly
    at random, the expected `experts * (1 - (1 - top / experts) ** B)` distinct experts of each layer, not all.
    `state_bytes`: a hybrid model's recurrent states of one sequence, which every decode step reads and writes."""
    groups = [(kv_bytes_per_token, None)] if isinstance(kv_bytes_per_token, int) else kv_bytes_per_token
    expert_bytes, num_experts, top = experts
    prompts = np.array([len(p) for p, _ in workload], dtype=np.float64)
    outs = np.array([o for _, o in workload], dtype=np.int64)
    steps = int(outs.max()) if len(outs) else 0
    step_bytes, rows = np.zeros(steps), np.zeros(steps)
    for s in range(1, steps + 1):
        alive = outs >= s
        context = prompts[alive] + s - 1
        rows[s - 1] = int(alive.sum())
        touched = 1.0 - (1.0 - top / num_experts) ** rows[s - 1]
        total = weight_bytes - expert_bytes * (1.0 - touched)
        for per_token, window in groups:
            total += per_token * float((np.minimum(context, window) if window else context).sum())
        step_bytes[s - 1] = total + 2 * state_bytes * rows[s - 1]
    return step_bytes, rows


def decode_bound_s(workload: list[tuple[list[int], int]], weight_bytes: int,
                   kv_bytes_per_token: int | list[tuple[int, int | None]], bandwidth: float,
                   experts: tuple[int, int, int] = (0, 1, 1), state_bytes: int = 0) -> float:
    """Least time to read what `workload`'s decode steps must read, at `bandwidth` bytes/s: the issue's bound
    (`decode_step_bytes`)."""
    return float(decode_step_bytes(workload, weight_bytes, kv_bytes_per_token, experts, state_bytes)[0].sum()) \
        / bandwidth


def decode_roofline_s(workload: list[tuple[list[int], int]], weight_bytes: int,
                      kv_bytes_per_token: int | list[tuple[int, int | None]], bandwidth: float,
                      params_per_token: int, matmul_rate: float, experts: tuple[int, int, int] = (0, 1, 1),
                      state_bytes: int = 0) -> float:
    """Least decode time when a step also cannot beat the matrix units: the sum over steps of the larger of its bytes
    over `bandwidth` and its `2 x params_per_token x rows` matrix FLOPs over `matmul_rate` (FLOP/s).

    Why beside `decode_bound_s`: at a few hundred rows a step's GEMMs are near the GPU's ridge point (an H100 at about
    295 FLOP per byte of bf16 weights, an H200 at about 206 as its bandwidth is higher), so the bytes alone can understate
    what the steps with the most rows must take. Attention's own FLOPs are left out, so this is still a lower bound.
    `params_per_token`: the parameters a decode token multiplies (`prefill_params`' two figures added: in decode every
    row runs the output projection)."""
    step_bytes, rows = decode_step_bytes(workload, weight_bytes, kv_bytes_per_token, experts, state_bytes)
    return float(np.maximum(step_bytes / bandwidth, 2.0 * params_per_token * rows / matmul_rate).sum())


def prefill_params(model) -> tuple[int, int]:
    """(parameters each prompt token multiplies, parameters only each prompt's last token multiplies) in this
    process: the first leaves out the embedding tables (a gather, no product; the output projection is applied to the
    rows a step keeps, one per prompt, `logits_to_keep`) and, in a mixture of experts, counts the routed experts at
    `experts per token / experts`; the second is the output projection. Under tensor parallelism, this rank's
    shards."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tables = {_key(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = {_key(output.weight)} if output is not None and hasattr(output, "weight") else set()
    seen, dense, experts = set(), 0, 0
    for name, p in model.named_parameters():
        key = _key(p)
        if key in seen or key in tables | head:
            continue
        seen.add(key)
        if ".experts." in f".{name}":
            experts += _local(p).numel()
        else:
            dense += _local(p).numel()
    _, num_experts, top = expert_weights(model)
    head_params = _local(output.weight).numel() if head else 0
    return dense + round(experts * top / num_experts), head_params


def prefill_flops(workload: list[tuple[list[int], int]], config, token_params: int, prompt_params: int = 0) -> float:
    """FLOPs to prefill every prompt once, no prefix reuse: 2 x `token_params` per token and 2 x `prompt_params` per
    prompt (`prefill_params`: the output projection runs on each prompt's last token only), plus the causal
    attention's `QK^T` and `PV` products (a sliding-window layer's query sees at most its window of keys)."""
    text = _text_config(config)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    layers = text.num_hidden_layers
    sliding, window = _sliding_layers(text)

    def pairs(n: int, w: int | None) -> float:  # (query, key) pairs of a causal prompt of n tokens, keys within w
        if w is None or n <= w:
            return n * (n + 1) / 2
        return w * (w + 1) / 2 + (n - w) * w

    total = 0.0
    for prompt, _ in workload:
        n = len(prompt)
        attention = (layers - sliding) * pairs(n, None) + sliding * pairs(n, window)
        total += 2.0 * token_params * n + 2.0 * prompt_params + 4.0 * heads * head_dim * attention
    return total


def latency_stats(values: list[float]) -> dict:
    """mean / p50 / p99 in milliseconds of values in seconds (NaN when empty)."""
    if not values:
        return {"mean_ms": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    arr = np.asarray(values) * 1000
    return {"mean_ms": float(arr.mean()), "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99))}
