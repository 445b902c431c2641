"""How many KV blocks an engine's pool gets: profiled on CUDA when neither `num_blocks` nor `kv_cache_memory` is given,
and, under tensor parallelism, the count every rank agrees on.

vLLM's semantics: `gpu_memory_utilization` is the fraction of the *whole device* this engine may use, for the weights,
the activations of the largest step and the KV pool together; the pool gets what the other two leave. The fraction
says nothing of what is free, though: another process on the device (a second server, a training job, a notebook) or
memory this process holds outside torch's allocator can leave less free than the fraction promises. Sized on the
fraction alone, the pool was then allocated (or not: a bare CUDA out-of-memory error while building the engine), and
the first full-budget prefill ran out of memory in the middle of serving. So the pool's size is checked against the
memory free after profiling, and a shortfall is a `ValueError` at construction that names the argument to change, as
vLLM does at start-up.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from ..attention import profile_state_specs
from ..cache import (
    BLOCKLESS_POOL_BLOCKS,
    GroupedPagedCache,
    PagedCache,
    StatePool,
    checkpoint_kv_scales,
    memory_fraction,
    parse_memory,
    plan_for,
    resolve_kv_cache_dtype,
)
from ..kernels import get_backend
from ..runner import recording

_GIB = 2**30


def build_engine_cache(model, tp, device: torch.device, dtype: torch.dtype, *, block_size: int,
                       kv_heads: int | None, num_blocks: int | None, kv_cache_memory, gpu_memory_utilization: float,
                       swap_space: float, preemption_mode: str, max_num_seqs: int, max_num_batched_tokens: int,
                       enable_prefix_caching: bool, state_checkpoints: int | None, kv_cache_dtype: str = "auto",
                       kv_scales=None, group_layers: bool = False) -> tuple[PagedCache, dict]:
    """The engine's `PagedCache`, sized up front, and the model's recurrent-state specs (`{}` for attention-only
    models).

    One memory budget holds the KV blocks and, for a hybrid model, one recurrent-state slot per sequence
    (`max_num_seqs`), the prefix-cache checkpoints (`state_checkpoints`, default `max(8, max_num_seqs // 8)` with
    prefix caching) and a scratch slot (`state_memory`); `swap_space` holds the swapped blocks and the states of
    the sequences swapped with them.

    `kv_cache_dtype` "fp8" stores the blocks in one byte an element (the budget holds twice a bf16 pool's blocks);
    its scales are `kv_scales`, else those the model's checkpoint ships, else calibrated (`cache.kv_quant`).

    `group_layers` (the engine's `release_window_blocks`): a mixed sliding / full stack gets a `GroupedPagedCache`
    (one block table per layer group, `cache.grouped_cache.plan_for`), whose block holds one group's layers. A
    `num_blocks` given counts blocks of every layer (what a one-table pool of that memory holds): the grouped pool
    gets the same memory, in blocks of one group's page (`GroupedPagedCache.bytes_per_block`: ``group_size`` layers
    when every layer has one shape, else the page the layers of several shapes are packed in).

    The Triton kernels tile a block in 8 to 256 tokens: a `block_size` outside that on their device is refused here,
    where each step would otherwise fail every request it holds."""
    if get_backend(device) == "triton" and not 8 <= block_size <= 256:
        raise ValueError(f"block_size must be a power of two in [8, 256] on {device} (the Triton kernels' tiles), "
                         f"got {block_size}")
    probe = PagedCache(config=model.config, num_blocks=1, block_size=block_size, num_kv_heads=kv_heads)
    pool_dtype = resolve_kv_cache_dtype(kv_cache_dtype) or dtype
    if kv_scales is None and pool_dtype != dtype:
        kv_scales = checkpoint_kv_scales(model) or None
    specs = profile_state_specs(model)  # every recurrent state (shape, dtype), from one call of each mixer
    groups = plan_for(model.config, probe, fp8=pool_dtype != dtype, recurrent=bool(specs)) if group_layers else None
    if groups is not None:
        one_table = probe.bytes_per_block(pool_dtype)
        probe = GroupedPagedCache(config=model.config, num_blocks=1, block_size=block_size, num_kv_heads=kv_heads,
                                  layer_groups=groups)
        if num_blocks is not None:  # the same memory in blocks of one group's page
            num_blocks = num_blocks * one_table // probe.bytes_per_block(pool_dtype)
    per_block = probe.bytes_per_block(pool_dtype)
    per_slot = StatePool.spec_bytes(specs)
    checkpoints = 0
    if specs and enable_prefix_caching:
        checkpoints = max(8, max_num_seqs // 8) if state_checkpoints is None else state_checkpoints
    reserved = state_memory(per_slot, max_num_seqs, checkpoints) if specs else 0
    swap_bytes = int(swap_space * 1024**3)
    cpu_slots = max_num_seqs if specs and swap_bytes else 0
    if per_block == 0:  # no K/V layers (Mamba, FalconMamba): blocks only count tokens and cost nothing
        num_cpu_blocks = BLOCKLESS_POOL_BLOCKS if swap_bytes > cpu_slots * per_slot else 0
        num_blocks = num_blocks or BLOCKLESS_POOL_BLOCKS
    else:
        num_cpu_blocks = (swap_bytes - cpu_slots * per_slot) // per_block
    if preemption_mode == "swap" and num_cpu_blocks <= 0:
        raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of CPU memory for swapped blocks"
                         + (f"; the recurrent states of max_num_seqs sequences take "
                            f"{cpu_slots * per_slot / 2**30:.2f} GiB of it" if cpu_slots else "") + ")")
    kv_bytes = parse_memory(kv_cache_memory, "kv_cache_memory")
    if per_block == 0 and reserved > (kv_bytes or reserved):
        raise ValueError(f"the recurrent-state slots take {reserved / 2**20:.1f} MiB, more than kv_cache_memory's "
                         f"{kv_bytes / 2**20:.1f} MiB: give a larger kv_cache_memory, or a smaller max_num_seqs or "
                         "state_checkpoints")
    if per_block:  # (blocks that cost nothing need no sizing: every rank has the same count)
        num_blocks = engine_pool_blocks(model, probe, tp, device, pool_dtype, per_block, num_blocks, kv_bytes,
                                        max_num_batched_tokens, gpu_memory_utilization, reserved)
    cache = (PagedCache if groups is None else partial(GroupedPagedCache, layer_groups=groups))(
        config=model.config, num_kv_heads=kv_heads, num_blocks=num_blocks, block_size=block_size, device=device,
        dtype=dtype, kv_cache_memory=kv_bytes, gpu_memory_utilization=gpu_memory_utilization,
        num_cpu_blocks=max(num_cpu_blocks, 0),
        grow=False,  # the engine sizes its pool up front (vLLM-style) and preempts when it is full
        num_state_slots=max_num_seqs if specs else None, num_state_checkpoints=checkpoints, state_specs=specs,
        num_cpu_state_slots=cpu_slots, kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
    return cache, specs


def engine_pool_blocks(model, probe, tp, device: torch.device, dtype: torch.dtype, per_block: int,
                       num_blocks: int | None, kv_bytes: int | None, max_num_batched_tokens: int,
                       utilization: float, reserved: int = 0) -> int | None:
    """The block count an engine builds its pool with; `None` leaves it to `PagedCache` (CPU, or `kv_cache_memory`).

    `per_block`: the bytes of one block (`probe.bytes_per_block(dtype)`). `reserved`: bytes of the same budget that
    the pool must leave to the recurrent-state slots of a hybrid model (`state_memory`); with it, the CPU and
    `kv_cache_memory` cases are sized here too. On CUDA with neither `num_blocks` nor `kv_bytes`:
    `profile_pool_blocks`. Under tensor parallelism every rank sizes its own pool and they agree on the
    smallest count (one block table serves all ranks). A rank whose sizing fails still takes part in that agreement,
    with zero blocks, before it raises: the other ranks then raise too, instead of waiting in the collective for a rank
    that has given up.
    """
    failure = None
    try:
        if num_blocks is None and kv_bytes is None and device.type == "cuda":
            num_blocks = profile_pool_blocks(model, device, max_num_batched_tokens, per_block, utilization, reserved)
        elif num_blocks is None and reserved:
            num_blocks = reserved_pool_blocks(per_block, reserved, kv_bytes)
        if tp is not None and num_blocks is None:
            num_blocks = probe._auto_num_blocks(device, dtype) if kv_bytes is None else max(1, kv_bytes // per_block)
    except ValueError as error:
        if tp is None:
            raise
        failure, num_blocks = error, 0
    if tp is None:
        return num_blocks
    agreed = tp.agree_min(num_blocks, device)
    if failure is not None:
        raise failure
    if agreed < 1 and num_blocks >= 1:  # (a count below one that every rank was given is PagedCache's to refuse)
        raise ValueError("another tensor-parallel rank cannot fit its KV pool (that rank's error says why); every rank "
                         "stops")
    return agreed


def state_memory(per_slot: int, num_slots: int, num_checkpoints: int) -> int:
    """Bytes of a hybrid model's recurrent-state slots: one per sequence, the checkpoints, and the scratch slot."""
    return per_slot * (num_slots + num_checkpoints + 1)


def reserved_pool_blocks(per_block: int, reserved: int, kv_bytes: int | None) -> int:
    """Blocks of a pool that shares `kv_bytes` (default: $HF_PAGED_CPU_KV_MEMORY, the CPU pool's) with `reserved`
    bytes of recurrent states; a ValueError naming the arguments when nothing is left for blocks."""
    budget = kv_bytes if kv_bytes is not None else int(os.environ.get("HF_PAGED_CPU_KV_MEMORY", 512 * 1024**2))
    blocks = (budget - reserved) // per_block
    if blocks < 1:
        raise ValueError(
            f"the recurrent-state slots take {reserved / 2**20:.1f} MiB of the {budget / 2**20:.1f} MiB of "
            "kv_cache_memory, which leaves no room for a KV block: give a larger kv_cache_memory, or a smaller "
            "max_num_seqs (one slot a sequence) or state_checkpoints")
    return blocks


def profile_pool_blocks(model, device: torch.device, max_num_batched_tokens: int, per_block: int,
                        utilization: float, reserved: int = 0) -> int:
    """Run one forward at the full token budget, measure its peak, and size the pool (`pool_blocks`)."""
    recording.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    tokens = torch.zeros((1, max_num_batched_tokens), dtype=torch.long, device=device)
    with torch.inference_mode():
        model(input_ids=tokens, use_cache=False, logits_to_keep=min(256, max_num_batched_tokens))
    recording.device_synchronize(device)
    del tokens
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    recording.empty_cache()
    allocated = torch.cuda.memory_allocated(device)
    free = torch.cuda.mem_get_info(device)[0]
    return pool_blocks(per_block, utilization, total=total, peak=peak, allocated=allocated, free=free,
                       reserved=reserved)


def pool_blocks(per_block: int, utilization: float, *, total: int, peak: int, allocated: int, free: int,
                reserved: int = 0) -> int:
    """Blocks of `per_block` bytes in `total * utilization - peak`, checked against the memory `free` now.

    `peak`: torch's peak allocation during the profiling forward (weights, anything else this process holds in torch,
    and the activations). `allocated`: what torch holds once that forward is done; `peak - allocated` are the
    activations, which the first full-budget step allocates again. The pool and those activations must both fit in
    `free`: else the engine could not serve the steps it was sized for.
    """
    utilization = memory_fraction(utilization)
    budget = int(total * utilization) - peak - reserved  # `reserved`: a hybrid model's recurrent-state slots
    if budget < per_block:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache "
            f"(weights + activations peak at {peak / _GIB:.1f} GiB of {total / _GIB:.1f} GiB"
            + (f", recurrent-state slots take {reserved / _GIB:.2f} GiB: lower max_num_seqs or state_checkpoints"
               if reserved else "") + ")"
        )
    activations = max(peak - allocated, 0)
    if budget + reserved + activations > free:
        others = max(total - free - allocated, 0)
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives the KV cache {budget / _GIB:.2f} GiB of the device's "
            f"{total / _GIB:.1f} GiB, but only {free / _GIB:.2f} GiB are free for it and the "
            f"{activations / _GIB:.2f} GiB of activations of a full step: other processes, or memory held outside "
            f"torch, take {others / _GIB:.2f} GiB. Lower gpu_memory_utilization, or give the cache's size with "
            "kv_cache_memory (bytes, or a string such as '8GiB')"
        )
    return budget // per_block
