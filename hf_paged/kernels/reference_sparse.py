"""Sparse paged attention, the torch reference: each query attends exactly the positions an indexer selected for it.

Learned sparse attention (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5, ...) picks, for every query token, up to
`index_topk` positions of its own sequence; the attention then reads those positions' K/V only. Here the selection is
``positions [N, K]`` (int, ``-1`` = no key in that entry), each query row ``n`` reads the block table
``block_tables[rows[n]]`` (its sequence's), and the selected keys and values are gathered from the paged pool by
``block * block_size + offset``, so nothing is materialised per sequence beyond ``K`` keys per query.

Order of the selection does not matter (softmax over a set); duplicates would count twice, and the indexer's top-k
never gives any. A row without a selected key gives zeros. Attention sinks (per-head logits joining the denominator:
HY-V4's) and soft-capping are taken; windows, chunks and ALiBi are not (no sparse-attention family uses them).

This is the seam for a Triton kernel (the dispatcher, :func:`hf_paged.kernels.paged_sparse_attention`, calls this
on every backend today): it would read the same arguments.
"""

from __future__ import annotations

import torch

from .reference import dequantize, masked_attention

__all__ = ["paged_sparse_attention"]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, scale, dtype) -> torch.Tensor:
    """`[N, H, K, D]`: the cache entries at `blocks`/`offsets` `[N, K]` (an FP8 cache's dequantised)."""
    data = cache.view(torch.uint8) if scale is not None else cache
    gathered = data[blocks, :, offsets].view(cache.dtype)  # [N, K, H, D]
    return dequantize(gathered.transpose(1, 2), scale, dtype)


def paged_sparse_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, scale: float, *,
                           softcap: float | None = None, sinks: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``query [N, Hq, D]`` over its selected positions; returns ``[N, Hq, Dv]`` (module docstring)."""
    num, num_heads, dim = query.shape
    block_size, kv_heads = key_cache.shape[2], key_cache.shape[1]
    valid = positions >= 0
    pos = positions.clamp(min=0).long()
    blocks = block_tables.long()[rows.long()[:, None], pos // block_size]  # [N, K]
    offsets = pos % block_size
    keys = _gather(key_cache, blocks, offsets, k_scale, query.dtype).to(query.dtype)
    values = keys if value_cache is key_cache and v_scale is None else _gather(
        value_cache, blocks, offsets, v_scale, query.dtype).to(query.dtype)
    groups = num_heads // kv_heads
    q = query.view(num, kv_heads, groups, dim)  # query head h reads KV head h // groups
    mask = valid[:, None, None, :]  # [N, 1, 1, K]
    sink_col = sinks.reshape(1, kv_heads, groups, 1) if sinks is not None else None
    out = masked_attention(q, keys, values, mask, scale, softcap, sink_col)  # [N, Hkv, G, Dv]
    out = torch.where(valid.any(-1)[:, None, None, None], out, 0)
    return out.reshape(num, num_heads, out.shape[-1])
