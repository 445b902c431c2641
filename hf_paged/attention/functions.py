"""Route transformers' attention through the paged kernels.

`register()` adds one attention function and one mask function under the name `hf_paged` to transformers'
`AttentionInterface` / `AttentionMaskInterface`. The model's own modeling code stays untouched: it calls
`past_key_values.update(...)`, gets back the layer's block pools (tagged with their `PagedCache`), then calls our
attention function, which reads the current step's block tables from that cache.

The mask function builds no 4D mask: it hands the 2D padding mask through (or None), and the attention function turns
left padding into a per-row `kv_start`. Any other padding pattern, and calls without a `PagedCache` (e.g.
`use_cache=False`), take an exact SDPA path so results never silently change.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from .. import kernels
from .compiled_op import active_deferred_cache, fused_decode_attention

ATTENTION_NAME = "hf_paged"

__all__ = ["ATTENTION_NAME", "register", "paged_attention_forward", "paged_mask"]

_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux", "position_bias")


def paged_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function: pass the 2D padding mask (cut to the key length) through; never materialise `[B,1,q,kv]`."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        return attention_mask
    return attention_mask[:, -kv_length:] if attention_mask.shape[1] > kv_length else attention_mask


def _dense_mask(mask_2d: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """Causal (query i sits at position kv_len - q_len + i) AND padding, as a boolean `[B, 1, q, kv]` mask."""
    if mask_2d is None:
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    k_pos = torch.arange(kv_len, device=device)
    causal = k_pos[None, :] <= q_pos[:, None]
    return causal[None, None] & mask_2d.to(device=device, dtype=torch.bool)[:, None, None, :]


def _left_padding_starts(step, mask_2d: torch.Tensor | None, kv_len: int) -> tuple[bool, torch.Tensor | None]:
    """(is left padding only, per-row first valid key or None). Computed once per forward, cached on the step."""
    if step.kv_start_ready:
        return step.extra["left_padded"], step.kv_start
    left_padded, kv_start = True, None
    if mask_2d is not None:
        valid = mask_2d.to(torch.bool)
        if valid.shape[1] != kv_len:
            left_padded = False
        else:
            has_any = valid.any(dim=1)
            first = valid.to(torch.int32).argmax(dim=1)
            expected = torch.arange(kv_len, device=valid.device)[None, :] >= first[:, None]
            ok = ((expected == valid) | ~has_any[:, None]).all()
            starts = torch.where(has_any, first, torch.full_like(first, kv_len)).to(torch.int32)
            flags = torch.stack([ok.to(torch.int32), starts.max()]).tolist()  # one host sync per forward
            left_padded = bool(flags[0])
            if left_padded and flags[1] > 0:
                kv_start = starts.to(step.seq_lens.device)
    step.extra["left_padded"] = left_padded
    step.kv_start = kv_start
    step.kv_start_ready = True
    return left_padded, kv_start


def _gather_dense(cache_tensor: torch.Tensor, block_tables: torch.Tensor, kv_len: int) -> torch.Tensor:
    """`[B, H, kv_len, D]` copy of every row's first kv_len tokens (exact fallback for unusual padding)."""
    block_size = cache_tensor.shape[2]
    pos = torch.arange(kv_len, device=cache_tensor.device)
    blocks = block_tables.long()[:, pos // block_size]  # [B, kv_len]
    gathered = cache_tensor[blocks, :, (pos % block_size)[None, :].expand_as(blocks), :]  # [B, kv_len, H, D]
    return gathered.transpose(1, 2)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: `query [B, Hq, q, D]`, returns `([B, q, Hq, D], None)`."""
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"hf_paged attention does not support `{name}` (model passed {name}={kwargs[name]!r})")
    if torch.compiler.is_compiling():
        # inside hf_paged's compiled decode step (`compile_decode`): the cache deferred the K/V write to one fused op
        active = active_deferred_cache()
        if active is not None:
            scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
            return fused_decode_attention(module, query, key, value, scale, active.dtype), None
    cache_ref = getattr(key, "_hf_paged_cache", None)
    cache = cache_ref() if cache_ref is not None else None
    if cache is None:
        # No paged cache in this forward (use_cache=False, DynamicCache, ...): exact SDPA with a dense mask.
        mask = attention_mask
        if mask is not None and mask.dim() == 2:
            mask = _dense_mask(mask, query.shape[2], key.shape[2], query.device)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)

    step = cache._step
    if query.requires_grad:  # gradients stop at the paged cache (see hf_paged.cache.paged_cache._cut_gradients)
        query = query.detach()
    batch, num_heads, q_len, head_dim = query.shape
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    if step.layout == "ragged":
        flat = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
        if step.decode_only:
            out = kernels.paged_decode(flat, key, value, step.block_tables, step.seq_lens, scale)
        else:
            out = kernels.paged_prefill(
                flat, key, value, step.block_tables, step.cu_seqlens_q, step.seq_lens, scale, step.max_seqlen_q
            )
        return out.unsqueeze(0), None

    kv_len = cache.get_seq_length()
    left_padded, kv_start = _left_padding_starts(step, attention_mask, kv_len)
    if not left_padded:
        keys = _gather_dense(key, step.block_tables, kv_len)
        values = _gather_dense(value, step.block_tables, kv_len)
        mask = _dense_mask(attention_mask, q_len, kv_len, query.device)
        return sdpa_attention_forward(module, query, keys, values, mask, dropout=0.0, scaling=scaling)
    if q_len == 1:
        out = kernels.paged_decode(
            query[:, :, 0, :].contiguous(), key, value, step.block_tables, step.seq_lens, scale, kv_start
        )
        return out.unsqueeze(1), None
    flat = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
    out = kernels.paged_prefill(
        flat, key, value, step.block_tables, step.cu_seqlens_q, step.seq_lens, scale, q_len, kv_start
    )
    return out.view(batch, q_len, num_heads, head_dim), None


_registered = False


def register() -> str:
    """Register the attention and mask functions (idempotent); returns the implementation name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)
        _registered = True
    return ATTENTION_NAME
