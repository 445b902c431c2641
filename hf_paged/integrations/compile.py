"""Optional kernel fusion: compile a model's pure-tensor submodules with `torch.compile`.

A decode step of a small model is bound by the number of kernels it launches, not by its arithmetic: transformers'
RMSNorm alone is about eight elementwise kernels (cast, square, mean, add, rsqrt, multiply, cast, scale), run twice per
layer, and the rotary embedding and the MLP activation add more. `nn.Module.compile` lets Inductor fuse each such
submodule into one or two kernels while the model keeps running its own code: nothing is rewritten, the submodules
are only called through their compiled form. The attention (hf_paged's Triton kernels, reached through the cache and
the registered attention function) stays outside the compiled regions.

Compilation takes seconds to minutes the first time each submodule runs, so `Engine.warm_up()` is the place to pay
it. Shapes are compiled dynamic in the token dimension, so one compilation serves every batch size. Results are those
of the uncompiled modules up to floating-point reassociation in the fused reductions.
"""

from __future__ import annotations

import threading

import torch

from .. import kernels

__all__ = ["compile_submodules", "uncompile_submodules", "active_cache", "write_and_decode", "fused_decode_attention"]

#: class-name suffixes of the submodules compiled: their forward is tensor arithmetic only
FUSABLE_SUFFIXES = ("RMSNorm", "RotaryEmbedding", "MLP")
_MARK = "_hf_paged_compiled"


def compile_submodules(model: torch.nn.Module, *, dynamic: bool = True) -> int:
    """Compile every RMSNorm, rotary-embedding and MLP submodule of `model` in place; return how many.

    Idempotent: a submodule compiled already (by this function or by the user) is left as it is.
    """
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith(FUSABLE_SUFFIXES) and getattr(module, "_compiled_call_impl", None) is None:
            module.compile(dynamic=dynamic)
            setattr(module, _MARK, True)
            count += 1
    return count


def uncompile_submodules(model: torch.nn.Module) -> int:
    """Undo `compile_submodules` (only the submodules it compiled); return how many were restored."""
    count = 0
    for module in model.modules():
        if getattr(module, _MARK, False):
            module._compiled_call_impl = None
            delattr(module, _MARK)
            count += 1
    return count


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
                     scale: float) -> torch.Tensor:
    """Write `key`/`value` `[T, Hkv, D]` at the step's slots of layer `layer_idx`, then decode `query` `[T, Hq, D]`."""
    cache = _ACTIVE[0]
    if cache is None or cache._step is None:
        raise RuntimeError("hf_paged::write_and_decode ran outside hf_paged's compiled decode step (no active cache)")
    step = cache._step
    key_cache, value_cache = cache.layer_caches(layer_idx)
    kernels.write_kv(key, value, key_cache, value_cache, step.slot_mapping)
    return kernels.paged_decode(query, key_cache, value_cache, step.block_tables, step.seq_lens, scale, step.kv_start)


@write_and_decode.register_fake
def _(query, key, value, layer_idx, scale):
    return torch.empty_like(query)


def fused_decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                           cache_dtype: torch.dtype) -> torch.Tensor:
    """Traced part of the attention of a compiled decode step: layouts in, one op, layout out.

    `query [1, Hq, T, D]`, `key`/`value [1, Hkv, T, D]` (the new tokens: `PagedCache.update` deferred the write);
    returns `[1, T, Hq, D]`. The transposes are fused by Inductor into the kernels that produce q/k/v.
    """
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise ValueError(f"compile_decode needs attention modules with an int `layer_idx`, {type(module).__name__} "
                         f"has {layer_idx!r}")
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).to(cache_dtype).contiguous()
    v = value[0].transpose(0, 1).to(cache_dtype).contiguous()
    return torch.ops.hf_paged.write_and_decode(q, k, v, layer_idx, float(scale)).unsqueeze(0)
