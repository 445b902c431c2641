"""Plain-torch implementations of the paged-KV kernels.

These are both the test oracle for the Triton kernels and the production path on
CPU (and on any device where Triton is not available), so they are vectorised:
attention gathers each sequence's K/V through its block table into contiguous
tensors and calls ``torch.nn.functional.scaled_dot_product_attention`` with an
explicit boolean mask. Query rows whose key range is empty get zeros.

Layouts follow the contract of :mod:`hf_paged.kernels` (pool layout, kernel API):
``key_cache`` / ``value_cache`` are ``[num_blocks, num_kv_heads, block_size, head_dim]``
and token slot ``block_id * block_size + offset``.

An FP8 cache (``float8_e4m3fn``, with ``k_scale`` / ``v_scale``: see :mod:`hf_paged.kernels`) is written through
`quantize` and read through `dequantize` (``stored * scale`` in float32, then the query's dtype). Its indexing runs
on a ``uint8`` view of the same bytes, which every device's index kernels take.

``naive_attention`` (and the ``naive_paged_*`` wrappers) is an independent
explicit-softmax implementation in float64 used by the tests only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "quantize",
    "dequantize",
    "write_kv",
    "paged_decode",
    "paged_prefill",
    "copy_blocks",
    "masked_attention",
    "naive_attention",
    "naive_paged_decode",
    "naive_paged_prefill",
]

# Bound on the number of gathered K (or V) elements per decode chunk, so that a
# large batch does not materialise its whole context at once on the CPU.
_DECODE_GATHER_ELEMS = 1 << 25


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., H, D]`` as an FP8 cache stores it: ``clamp(x / scale, -448, 448)`` rounded to nearest even, with
    `scale` ``[1]`` or ``[H]`` (float32)."""
    return (x.float() / scale.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache values ``[..., H, L, D]`` read as `dtype`: ``stored * scale`` (per head) in float32 for an FP8 cache
    (`scale` ``[1]`` or ``[H]``); a 16/32-bit cache's as they are (`scale` None)."""
    if scale is None:
        return stored
    return (stored.float() * scale.reshape(-1, 1, 1)).to(dtype)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as the `uint8` tensor of its bytes (a view) for indexing; any other cache as it is."""
    return cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache


# --------------------------------------------------------------------------- #
# cache ops
# --------------------------------------------------------------------------- #
def write_kv(
    key: torch.Tensor,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """``key_cache[slot // bs, :, slot % bs] = key`` for every token with slot >= 0 (quantised for an FP8 cache); the
    values likewise, unless `value` is None (a layer whose values are its keys)."""
    block_size = key_cache.shape[2]
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        slots = slots[valid]
        key = key[valid]
        value = value[valid] if value is not None else None
    if slots.numel() == 0:
        return
    blk = torch.div(slots, block_size, rounding_mode="floor")
    off = slots - blk * block_size
    if k_scale is not None:
        key = quantize(key, k_scale)
        value = quantize(value, v_scale) if value is not None else None
    # advanced indices separated by a slice: result dims are [n, Hkv, D]
    _bytes(key_cache)[blk, :, off] = _bytes(key.to(key_cache.dtype))
    if value is not None:
        _bytes(value_cache)[blk, :, off] = _bytes(value.to(value_cache.dtype))


def copy_blocks(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``pool[..., dst[i], :, :, :] = pool[..., src[i], :, :, :]`` (block dim ``pool.dim()-4``)."""
    src = src.to(device=pool.device, dtype=torch.long)
    dst = dst.to(device=pool.device, dtype=torch.long)
    if src.numel() == 0:
        return
    lead = (slice(None),) * (pool.dim() - 4)
    pool = _bytes(pool)
    pool[lead + (dst,)] = pool[lead + (src,)]


# --------------------------------------------------------------------------- #
# attention
# --------------------------------------------------------------------------- #
def _gather_kv(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``cache[table]`` -> ``[..., Hkv, n_blocks * block_size, D]`` (table ``[..., n_blocks]``), in the cache's dtype."""
    nb, hkv, bs, d = cache.shape
    table = table.to(dtype=torch.long).clamp(0, nb - 1)
    g = _bytes(cache)[table].view(cache.dtype)  # [..., n, Hkv, bs, D]
    g = g.transpose(-3, -4)  # [..., Hkv, n, bs, D]
    return g.reshape(*g.shape[:-3], g.shape[-3] * bs, d)


def _window_lo(kv_lo, pos, sliding_window, chunk_size):
    """First key a query at ``pos`` may see: padding start, raised by a window and / or a chunk start."""
    if sliding_window is not None:
        kv_lo = torch.maximum(kv_lo, pos - sliding_window + 1)
    if chunk_size is not None:
        rel = torch.clamp(pos - kv_lo, min=0) if not isinstance(pos, int) else max(pos - kv_lo, 0)
        kv_lo = kv_lo + (rel // chunk_size) * chunk_size
    return kv_lo


def _feature_mask(q_pos, key_pos, lo: int, sliding_window, chunk_size) -> torch.Tensor:
    """``[Lq, Lk]`` boolean: causal, ``key >= lo``, in the window (``q - k < W``), in the query's chunk."""
    mask = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] >= lo)
    if sliding_window is not None:
        mask &= (q_pos[:, None] - key_pos[None, :]) < sliding_window
    if chunk_size is not None:
        mask &= torch.div(key_pos[None, :] - lo, chunk_size, rounding_mode="floor") == torch.div(
            q_pos[:, None] - lo, chunk_size, rounding_mode="floor"
        )
    return mask


def masked_attention(q, k, v, mask, scale, softcap=None, sink_col=None, bias=None):
    """Masked attention ``q [.., M, D] @ k [.., L, D] -> [.., M, Dv]``; SDPA unless softcap / sinks need explicit math.

    ``sink_col`` (broadcastable to ``[.., M, 1]``) is one extra logit per row that only joins the denominator
    (gpt-oss ``s_aux``). ``bias`` (broadcastable to ``[.., M, L]``, float32) is added to the scaled (and capped)
    logits: ALiBi. Rows with no key give zeros (the caller masks them).
    """
    if softcap is None and sink_col is None:
        if bias is not None:  # one additive float mask: the bias where a key is visible, -inf elsewhere
            mask = torch.where(mask, bias.to(q.dtype), float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~mask, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    if sink_col is not None:
        mx = torch.maximum(mx, sink_col.float())
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(s - mx)
    denom = p.sum(-1, keepdim=True)
    if sink_col is not None:
        denom = denom + torch.exp(sink_col.float() - mx)
    p = p / torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.matmul(p, v.float()).to(q.dtype)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_start: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence attending keys ``[kv_start[b], seq_lens[b])``.

    Options (see :func:`hf_paged.kernels.paged_decode`): ``sliding_window`` W keeps keys with ``q - k < W``,
    ``chunk_size`` C keeps keys in the query's chunk (counted from ``kv_start``), ``softcap`` caps the scaled
    logits with ``softcap * tanh(x / softcap)``, ``sinks [Hq]`` adds ``exp(sink)`` to each head's denominator,
    ``alibi_slopes [Hq]`` adds ``slope[h] * (k - q)`` to each logit.
    """
    B, Hq, D = query.shape
    _, Hkv, bs, _ = key_cache.shape
    Dv = value_cache.shape[-1]
    G = Hq // Hkv
    out = query.new_zeros(B, Hq, Dv)
    if B == 0:
        return out
    seq_lens = seq_lens.to(device=query.device, dtype=torch.long)
    if kv_start is None:
        kv_lo = torch.zeros_like(seq_lens)
    else:
        kv_lo = kv_start.to(device=query.device, dtype=torch.long)
    # the one query sits at seq_len - 1: a window or a chunk only raises the first key it may see
    kv_lo = _window_lo(kv_lo, seq_lens - 1, sliding_window, chunk_size)
    sink_col = sinks.reshape(1, Hkv, G, 1) if sinks is not None else None
    if query.device.type == "cpu":
        max_len = int(seq_lens.max())
        n_blocks = min(block_tables.shape[1], max(1, -(-max_len // bs)))
    else:  # avoid a device sync: gather the whole table width
        n_blocks = block_tables.shape[1]
    if n_blocks == 0:
        return out
    L = n_blocks * bs
    per_seq = Hkv * L * D
    chunk = max(1, _DECODE_GATHER_ELEMS // max(1, per_seq))
    pos = torch.arange(L, device=query.device)
    for b0 in range(0, B, chunk):
        b1 = min(B, b0 + chunk)
        table = block_tables[b0:b1, :n_blocks]
        k = dequantize(_gather_kv(key_cache, table), k_scale, query.dtype)  # [b, Hkv, L, D]
        v = dequantize(_gather_kv(value_cache, table), v_scale, query.dtype)
        valid = (pos[None, :] >= kv_lo[b0:b1, None]) & (pos[None, :] < seq_lens[b0:b1, None])  # [b, L]
        vm = valid[:, None, :, None]
        # pad slots may hold garbage / NaN: never let it reach the matmuls
        k = torch.where(vm, k, 0)
        v = torch.where(vm, v, 0)
        # pack the G query heads of a KV head into the "query length" dim: no K/V expansion
        q = query[b0:b1].reshape(b1 - b0, Hkv, G, D)
        bias = None
        if alibi_slopes is not None:  # slope * (key - query), the query at seq_len - 1: [b, Hkv, G, L]
            rel = (pos[None, :] - seq_lens[b0:b1, None] + 1).float()
            bias = alibi_slopes.float().reshape(1, Hkv, G, 1) * rel[:, None, None, :]
        o = masked_attention(q, k, v, valid[:, None, None, :], scale, softcap, sink_col, bias)
        o = torch.where(valid.any(-1)[:, None, None, None], o, 0)
        out[b0:b1] = o.reshape(b1 - b0, Hq, Dv)
    return out


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    kv_start: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of new tokens over their cached prefix and themselves (options as in decode)."""
    T, Hq, D = query.shape
    _, Hkv, bs, _ = key_cache.shape
    Dv = value_cache.shape[-1]
    G = Hq // Hkv
    out = query.new_zeros(T, Hq, Dv)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    starts = kv_start.tolist() if kv_start is not None else [0] * len(lens)
    dev = query.device
    for s in range(len(lens)):
        q0, q1 = int(cu[s]), int(cu[s + 1])
        q_len = q1 - q0
        seq_len = int(lens[s])
        lo = max(0, int(starts[s]))
        if q_len <= 0 or seq_len <= lo:
            continue
        n_blocks = -(-seq_len // bs)
        table = block_tables[s, :n_blocks]
        k = dequantize(_gather_kv(key_cache, table)[:, lo:seq_len], k_scale, query.dtype)  # [Hkv, Lk, D]
        v = dequantize(_gather_kv(value_cache, table)[:, lo:seq_len], v_scale, query.dtype)
        key_pos = torch.arange(lo, seq_len, device=dev)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
        mask = _feature_mask(q_pos, key_pos, lo, sliding_window, chunk_size)  # [q_len, Lk]
        if sliding_window is not None or chunk_size is not None:
            # keys before every row's window / chunk are never read: they may be stale or garbage
            used = mask.any(0)[None, :, None]
            k, v = torch.where(used, k, 0), torch.where(used, v, 0)
        q = query[q0:q1].reshape(q_len, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * q_len, D)
        m = mask.unsqueeze(0).expand(G, q_len, -1).reshape(1, 1, G * q_len, -1)
        sink_col = None
        if sinks is not None:
            sink_col = sinks.reshape(Hkv, G, 1).expand(Hkv, G, q_len).reshape(1, Hkv, G * q_len, 1)
        bias = None
        if alibi_slopes is not None:  # slope * (key - query): [1, Hkv, G * q_len, Lk]
            rel = (key_pos[None, :] - q_pos[:, None]).float()
            bias = (alibi_slopes.float().reshape(Hkv, G, 1, 1) * rel).reshape(1, Hkv, G * q_len, -1)
        o = masked_attention(q, k.unsqueeze(0), v.unsqueeze(0), m, scale, softcap, sink_col, bias)
        o = torch.where(m.any(-1, keepdim=True), o, 0)
        out[q0:q1] = o.reshape(Hkv, G, q_len, Dv).permute(2, 0, 1, 3).reshape(q_len, Hq, Dv)
    return out


# --------------------------------------------------------------------------- #
# naive math oracle (tests)
# --------------------------------------------------------------------------- #
def naive_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    q_positions: torch.Tensor | list[int],
    kv_start: int = 0,
    dtype: torch.dtype = torch.float64,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Explicit-softmax attention of one sequence.

    query ``[Lq, Hq, D]``; key / value ``[Lk, Hkv, D]`` (key ``j`` sits at position ``j``);
    row ``i`` attends keys ``kv_start <= j <= q_positions[i]``. Empty rows give zeros.
    Computed in ``dtype`` (float64 by default) and returned in ``dtype``. The options mirror
    transformers' masks: window ``kv > q - W``, chunk ``(kv - start) // C == (q - start) // C``,
    softcap on the scaled logits before masking, sinks as an extra softmax column that is dropped, ALiBi as
    ``slope[h] * (k - q)`` added to the (capped) logits.
    """
    Lq, Hq, D = query.shape
    Lk, Hkv, _ = key.shape
    G = Hq // Hkv
    q = query.to(dtype)
    qp = torch.as_tensor(q_positions, device=query.device).reshape(Lq, 1)
    kp = torch.arange(Lk, device=query.device).reshape(1, Lk)
    mask = (kp >= kv_start) & (kp <= qp)  # [Lq, Lk]
    if sliding_window is not None:
        mask &= kp > qp - sliding_window
    if chunk_size is not None:
        mask &= (kp - kv_start) // chunk_size == (qp - kv_start) // chunk_size
    # keys no row attends may be garbage (NaN): drop them before any arithmetic
    used = mask.any(0).reshape(Lk, 1, 1)
    k = torch.where(used, key.to(dtype), 0).repeat_interleave(G, dim=1)  # [Lk, Hq, D]
    v = torch.where(used, value.to(dtype), 0).repeat_interleave(G, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.to(dtype).reshape(Hq, 1, 1) * (kp - qp).to(dtype)[None]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(dtype).reshape(Hq, 1, 1).expand(Hq, Lq, 1)], dim=-1)
    mx = scores.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = torch.exp(scores - mx)
    if sinks is not None:
        p = p.masked_fill(~torch.cat([mask, mask.new_ones(Lq, 1)], dim=-1), 0.0)
        denom = p.sum(-1, keepdim=True)
        p = p[..., :Lk]
    else:
        p = p.masked_fill(~mask, 0.0)
        denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.einsum("hqk,khd->qhd", p, v)


def _naive_seq_kv(key_cache, value_cache, table_row, n_tokens):
    bs = key_cache.shape[2]
    idx = torch.arange(n_tokens, device=key_cache.device)
    blk = table_row.to(torch.long)[idx // bs]
    off = idx % bs
    return key_cache[blk, :, off], value_cache[blk, :, off]  # [n, Hkv, D]


def naive_paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, kv_start=None, **opts):
    """float64 oracle for :func:`paged_decode` (per-token slot arithmetic, explicit softmax)."""
    B, Hq, _ = query.shape
    out = torch.zeros(B, Hq, value_cache.shape[-1], dtype=torch.float64, device=query.device)
    for b in range(B):
        n = int(seq_lens[b])
        lo = int(kv_start[b]) if kv_start is not None else 0
        if n <= 0:
            continue
        k, v = _naive_seq_kv(key_cache, value_cache, block_tables[b], n)
        out[b] = naive_attention(query[b : b + 1], k, v, scale, [n - 1], kv_start=lo, **opts)[0]
    return out


def naive_paged_prefill(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_seqlen_q=None, kv_start=None,
    **opts,
):
    """float64 oracle for :func:`paged_prefill`."""
    T, Hq, _ = query.shape
    out = torch.zeros(T, Hq, value_cache.shape[-1], dtype=torch.float64, device=query.device)
    for s in range(seq_lens.shape[0]):
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        n = int(seq_lens[s])
        lo = int(kv_start[s]) if kv_start is not None else 0
        if q1 <= q0 or n <= 0:
            continue
        k, v = _naive_seq_kv(key_cache, value_cache, block_tables[s], n)
        pos = list(range(n - (q1 - q0), n))
        out[q0:q1] = naive_attention(query[q0:q1], k, v, scale, pos, kv_start=lo, **opts)
    return out
