"""The one opaque op of hf_paged's compiled layers (`compile_decode`): K/V write + paged attention.

Dynamo traces transformers' modeling code for a decode step and Inductor fuses everything but the attention, which
calls `hf_paged::write_and_decode`. The op finds the pool and the step metadata through the cache that
`active_cache(...)` names (set by the runner around compiled calls and graph capture), so neither is a graph input.
Imported by the attention function (inside a trace) and by the runner (to name the active cache).

The same compiled layers also run the engine's ragged prefill steps (`ModelRunner._execute_eager`): their token
dimension is the symbolic batch dimension of the decode step, so no second compilation is needed, and the op picks
the kernel from the step's metadata at run time: `paged_decode` when every sequence brings one token, `paged_prefill`
otherwise (the choice is made in Python, outside the traced graph, and a CUDA graph records the decode one).
"""

from __future__ import annotations

import threading

import torch

from .. import kernels

__all__ = ["active_cache", "write_and_decode", "fused_decode_attention", "active_deferred_cache", "active_state_pool"]

# --------------------------------------------------------------------------- whole decode forward
# `compile_decode`: Dynamo traces transformers' own modeling code for a decode step and Inductor fuses everything but
# the attention, which is one opaque custom op. The op writes the step's K/V and attends over the pool in one call;
# it finds the pool and the step metadata (block tables, slot mapping, lengths: the runner's persistent buffers)
# through the cache that `active_cache` names, so neither the pool nor the metadata is a graph input and the compiler
# never sees the pool being written (as vLLM does with its forward context). Writing and reading in one op also keeps
# the write from being dropped as dead code and from being reordered after the read.

_ACTIVE: list = [None]
# One compiled forward at a time names the active cache: two engines stepping in two threads (on the static path,
# where every step calls the compiled code; replaying a CUDA graph never reads `_ACTIVE`) take turns.
_ACTIVE_LOCK = threading.RLock()


class active_cache:  # noqa: N801 (a context manager used like a function)
    """`with active_cache(cache):` the fused decode op reads `cache` (set around compiled calls and graph capture)."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def __enter__(self):
        _ACTIVE_LOCK.acquire()
        self._previous = _ACTIVE[0]
        _ACTIVE[0] = self.cache
        return self.cache

    def __exit__(self, *exc) -> None:
        _ACTIVE[0] = self._previous
        _ACTIVE_LOCK.release()


@torch.library.custom_op("hf_paged::write_and_decode", mutates_args=())
def write_and_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                     scale: float, sliding_window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None, chunk_size: int | None = None,
                     alibi_slopes: torch.Tensor | None = None, cache_window: int | None = None) -> torch.Tensor:
    """Write `key`/`value` `[T, Hkv, D]` at the step's slots of layer `layer_idx`, then attend with `query`
    `[T, Hq, D]` (an FP8 pool's with the layer's scales): a decode step (one token per sequence) through
    `kernels.write_and_paged_decode` (the decode kernel writes them, and combines its splits with the step's
    `split_counters`), a ragged step with longer queries (prefill chunks, possibly beside decodes) through
    `kernels.write_kv` and `kernels.paged_prefill`, as the eager attention does.

    The options are the layer's (see `kernels.paged_decode`); constants of the traced graph except `sinks` and
    `alibi_slopes`. `cache_window` (Moshi's, `adapters.moshi`): the window on a decode step, each sequence's first key
    (`window_starts`) on a ragged one.
    """
    cache = _ACTIVE[0]
    if cache is None or cache._step is None:
        raise RuntimeError("hf_paged::write_and_decode ran outside hf_paged's compiled step (no active cache)")
    key_cache, value_cache = cache.layer_caches(layer_idx)
    # a grouped cache's layer reads and writes through its layer group's step (`StepMetadata.for_group`)
    main = cache._step
    step = main.for_group(getattr(key_cache, "_hf_paged_group", 0))
    k_scale, v_scale = cache.layer_scales(layer_idx)  # an FP8 pool's (static tensors: a CUDA graph reads them)
    if step.decode_only:  # the write is done by the decode kernel, which takes the new K/V from its input
        cache.calibrate_layer(layer_idx, key, value, step)  # (an FP8 pool's first write; never in a graph)
        return kernels.write_and_paged_decode(
            query, key, value, key_cache, value_cache, step.slot_mapping, step.block_tables, step.seq_lens, scale,
            step.kv_start, split_counters=step.split_counters, sliding_window=sliding_window or cache_window,
            softcap=softcap,
            sinks=sinks, chunk_size=chunk_size, alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale)
    cache.write_layer(layer_idx, key, value, main)
    first = window_starts(step, cache_window) if cache_window is not None else None
    return kernels.paged_prefill(query, key_cache, value_cache, step.block_tables, step.cu_seqlens_q,
                                 step.seq_lens, scale, step.max_seqlen_q, first, sliding_window=sliding_window,
                                 softcap=softcap, sinks=sinks, chunk_size=chunk_size, alibi_slopes=alibi_slopes,
                                 k_scale=k_scale, v_scale=v_scale)


def window_starts(step, window: int) -> torch.Tensor:
    """Each sequence's first key under a window its cache applies (`cache_window`): its length before this step
    minus `window - 1` (at least 0); the decode window itself for a one-token query."""
    q_lens = step.cu_seqlens_q[1:] - step.cu_seqlens_q[:-1]
    return (step.seq_lens - q_lens - window + 1).clamp(min=0).to(torch.int32)


@write_and_decode.register_fake
def _(query, key, value, layer_idx, scale, sliding_window=None, softcap=None, sinks=None, chunk_size=None,
      alibi_slopes=None, cache_window=None):
    return query.new_empty(query.shape[0], query.shape[1], value.shape[-1])


def fused_decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                           cache_dtype: torch.dtype, sliding_window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None, chunk_size: int | None = None,
                           alibi_slopes: torch.Tensor | None = None, cache_window: int | None = None) -> torch.Tensor:
    """Traced part of the attention of a compiled decode step: layouts in, one op, layout out.

    `query [1, Hq, T, D]`, `key`/`value [1, Hkv, T, D]` (the new tokens: `PagedCache.update` deferred the write),
    cast to `cache_dtype` (the cache's `compute_dtype`: an FP8 pool quantises them in the op); returns
    `[1, T, Hq, D]`. The transposes are fused by Inductor into the kernels that produce q/k/v.
    """
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise ValueError(f"compile_decode needs attention modules with an int `layer_idx`, {type(module).__name__} "
                         f"has {layer_idx!r}")
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).to(cache_dtype).contiguous()
    v = value[0].transpose(0, 1).to(cache_dtype).contiguous()
    return torch.ops.hf_paged.write_and_decode(q, k, v, layer_idx, float(scale), sliding_window, softcap, sinks,
                                               chunk_size, alibi_slopes, cache_window).unsqueeze(0)


def active_deferred_cache():
    """The cache of the compiled decode step being traced, if it deferred its K/V write to the fused op; else None."""
    active = _ACTIVE[0]
    return active if active is not None and active._defer_write else None


def active_state_pool():
    """The recurrent-state pool of the active cache: what the compiled step's state ops (`recurrent.gather_state`,
    `commit_states`, `gdn_decode_slots`, `mamba2.mamba2_decode_slots`) read and write, by layer index."""
    cache = _ACTIVE[0]
    if cache is None or cache.states is None:
        raise RuntimeError("hf_paged's recurrent-state ops ran outside hf_paged's compiled step (no active cache)")
    return cache.states.pool
