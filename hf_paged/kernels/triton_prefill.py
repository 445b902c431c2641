"""Paged varlen causal prefill attention in Triton (flash-attention style, online softmax).

Grid ``(q_tiles, Hkv, S)`` with ``q_tiles = cdiv(max_seqlen_q, BLOCK_Q)`` (a Python int,
so no device sync); tiles past a sequence's query length exit at once. A tile packs
``BLOCK_Q`` query tokens x the ``G = Hq // Hkv`` query heads of one KV head into its
``BLOCK_M = BLOCK_Q * G`` rows (rounded up to a power of two), so each K/V tile read
through the block table serves the whole GQA group, and short queries (chunked
prefill, decode-like steps) still fill a ``tl.dot`` tile.

Query row ``i`` of sequence ``s`` sits at position ``p = seq_lens[s] - q_len_s + i`` and
attends keys ``[kv_start[s], p]``. Rows outside every sequence (output pre-zeroed)
and rows with an empty range get zeros.

An FP8 cache (`triton_fp8`): K/V tiles are converted to the query's dtype after their load; the KV head's key scale
joins the logit scale and its value scale multiplies the accumulator before the normalisation.

A query tile's key tiles that every one of its rows sees whole (all but the diagonal ones of a
long prompt) are read in a loop of their own without masks (``WHOLE``, `_whole_tiles`).

Imported lazily by :mod:`hf_paged.kernels` (needs triton).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_attention_end import _normalise
from .triton_cache import scale_stride
from .triton_dims import _dim_mask, padded_dim

_LOG2E = 1.4426950408889634


# The block-table row stride is the longest table of the step: it changes from step to step, and Triton would
# compile a variant per class of its value (1, a multiple of 16, other) at first use, a second-long stall in a
# serving step. It only scales one table load per K/V tile, so it is not specialised.
@triton.jit(do_not_specialize=["stride_btb"])
def _paged_prefill_kernel(
    Q,
    KC,
    VC,
    BT,
    CU,
    SEQ,
    KVS,
    OUT,
    SINK,
    ALIBI,
    KS,
    VS,
    qk_scale,
    sm_scale,
    softcap,
    window,
    chunk,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_btb,
    stride_ot,
    stride_oh,
    stride_s,
    G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_F32: tl.constexpr,
    WHOLE: tl.constexpr,
    QUANT: tl.constexpr,
):
    # heavy (late) tiles first for better load balance of the causal triangle
    qt = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)

    q_start = tl.load(CU + s).to(tl.int32)
    q_len = tl.load(CU + s + 1).to(tl.int32) - q_start
    if qt * BLOCK_Q < q_len:
        seq_len = tl.load(SEQ + s).to(tl.int32)
        if HAS_KV_START:
            kv_lo = tl.maximum(tl.load(KVS + s).to(tl.int32), 0)
        else:
            kv_lo = 0
        ctx = seq_len - q_len  # position of query row 0

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)  # a head dim that is no power of two is padded, its extra lanes masked
        offs_dv = tl.arange(0, DV_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        tq = qt * BLOCK_Q + offs_m // G  # query token index within the sequence
        head = kvh * G + offs_m % G
        row_ok = (offs_m < BLOCK_Q * G) & (tq < q_len)
        pos = ctx + tq

        rows = (q_start + tq).to(tl.int64)
        q = tl.load(
            Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=_dim_mask(row_ok[:, None], offs_d[None, :], HEAD_DIM, D_PAD),
            other=0.0,
        )

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
        slope = l_i  # ALiBi: each row's head's slope, in base 2 (the logits are scaled by log2(e))
        if HAS_ALIBI:
            slope = tl.load(ALIBI + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634

        # last key any row of this tile may see (+1)
        hi = tl.minimum(ctx + tl.minimum((qt + 1) * BLOCK_Q, q_len), seq_len)
        bt_row = BT + s.to(tl.int64) * stride_btb
        k_base = KC + kvh.to(tl.int64) * stride_kh
        v_base = VC + kvh.to(tl.int64) * stride_vh
        if QUANT:  # an FP8 cache: q . (k * ks) = ks * (q . k), so the key scale joins the logit scale
            ks = tl.load(KS + kvh * stride_s)
            qk_scale = qk_scale * ks
            sm_scale = sm_scale * ks
        # first key any row of this tile may see: a window / chunk raises it, blocks before it are never read
        lo_tile = kv_lo
        pos0 = ctx + qt * BLOCK_Q
        if HAS_WINDOW:
            lo_tile = tl.maximum(lo_tile, pos0 - window + 1)
        if HAS_CHUNK:
            lo_tile = tl.maximum(lo_tile, kv_lo + (tl.maximum(pos0 - kv_lo, 0) // chunk) * chunk)
        start = (lo_tile // BLOCK_N) * BLOCK_N
        if WHOLE:
            # Key tiles that every row of the tile sees whole, [u_lo, u_hi): inside [lo_tile, hi), at or before the
            # first row's position (pos0), and (a window) after the last row's window start. They load without
            # bounds and skip the causal / window test and the -inf guard (see `_whole_tiles` for when and why; never
            # with a chunked-attention layer, whose chunk boundaries cut tiles anywhere).
            u_lo = tl.minimum(tl.cdiv(lo_tile, BLOCK_N) * BLOCK_N, hi)
            if HAS_WINDOW:
                last = ctx + tl.minimum((qt + 1) * BLOCK_Q, q_len) - 1
                u_lo = tl.minimum(tl.maximum(u_lo, tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N), hi)
            u_hi = tl.maximum(tl.minimum(((pos0 + 1) // BLOCK_N) * BLOCK_N, hi), u_lo)
            for t0 in range(start, u_lo, BLOCK_N):
                m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, bt_row, k_base, v_base, pos, lo_tile, hi, kv_lo,
                                              window, chunk, qk_scale, sm_scale, softcap, slope, stride_kb,
                                              stride_kt, stride_vb, stride_vt, offs_n, offs_d, offs_dv, HEAD_DIM,
                                              HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_SIZE, True, HAS_WINDOW, HAS_CHUNK,
                                              HAS_SOFTCAP, HAS_ALIBI, IEEE, DOT_F32)
            for t0 in range(u_lo, u_hi, BLOCK_N):
                m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, bt_row, k_base, v_base, pos, lo_tile, hi, kv_lo,
                                              window, chunk, qk_scale, sm_scale, softcap, slope, stride_kb,
                                              stride_kt, stride_vb, stride_vt, offs_n, offs_d, offs_dv, HEAD_DIM,
                                              HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_SIZE, False, HAS_WINDOW, HAS_CHUNK,
                                              HAS_SOFTCAP, HAS_ALIBI, IEEE, DOT_F32)
            for t0 in range(u_hi, hi, BLOCK_N):
                m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, bt_row, k_base, v_base, pos, lo_tile, hi, kv_lo,
                                              window, chunk, qk_scale, sm_scale, softcap, slope, stride_kb,
                                              stride_kt, stride_vb, stride_vt, offs_n, offs_d, offs_dv, HEAD_DIM,
                                              HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_SIZE, True, HAS_WINDOW, HAS_CHUNK,
                                              HAS_SOFTCAP, HAS_ALIBI, IEEE, DOT_F32)
        else:
            for t0 in range(start, hi, BLOCK_N):
                m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, bt_row, k_base, v_base, pos, lo_tile, hi, kv_lo,
                                              window, chunk, qk_scale, sm_scale, softcap, slope, stride_kb,
                                              stride_kt, stride_vb, stride_vt, offs_n, offs_d, offs_dv, HEAD_DIM,
                                              HEAD_DIM_V, D_PAD, DV_PAD, BLOCK_SIZE, True, HAS_WINDOW, HAS_CHUNK,
                                              HAS_SOFTCAP, HAS_ALIBI, IEEE, DOT_F32)

        if QUANT:  # sum p (v * vs) = vs * sum p v
            acc = acc * tl.load(VS + kvh * stride_s)
        o = _normalise(acc, m_i, l_i, SINK, head, row_ok, HAS_SINKS)
        tl.store(
            OUT + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
            o.to(OUT.dtype.element_ty),
            mask=_dim_mask(row_ok[:, None], offs_dv[None, :], HEAD_DIM_V, DV_PAD),
        )


@triton.jit
def _prefill_tile(q, m_i, l_i, acc, t0, bt_row, k_base, v_base, pos, lo_tile, hi, kv_lo, window, chunk, qk_scale,
                  sm_scale, softcap, slope, stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d, offs_dv,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """Keys ``[t0, t0 + BLOCK_N)`` of one query tile: the online-softmax state `(m_i, l_i, acc)` updated.

    `MASKED`: keys outside ``[lo_tile, hi)`` are not loaded and, with the causal / window / chunk rule, score -inf.
    Unmasked (a tile every row sees whole: see the kernel) the tile loads without bounds and skips those tests; its
    scores are all finite, so no row's maximum can be -inf, and (without a softcap or ALiBi) the scale joins the
    exponent's subtraction. ALiBi adds `slope * (key - query)` to the scaled (capped) logits."""
    tok = t0 + offs_n
    if MASKED:
        valid = (tok >= lo_tile) & (tok < hi)
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
    off = tok % BLOCK_SIZE
    k_ptrs = k_base + blk[None, :] * stride_kb + off[None, :] * stride_kt + offs_d[:, None]  # [D_PAD, BLOCK_N]
    if MASKED:
        k = tl.load(k_ptrs, mask=_dim_mask(valid[None, :], offs_d[:, None], HEAD_DIM, D_PAD), other=0.0)
    elif D_PAD != HEAD_DIM:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
    else:
        k = tl.load(k_ptrs)
    k = k.to(q.dtype)  # an FP8 cache's tile in the query's dtype (exact); else the same dtype already
    if DOT_F32:  # interpreter: no bf16 dot there, emulate with float32 operands
        sc = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    elif IEEE:
        sc = tl.dot(q, k, input_precision="ieee")
    else:
        sc = tl.dot(q, k)
    if HAS_SOFTCAP:  # cap the scaled logits (natural units), then go to base 2
        x = sc * sm_scale / softcap
        sc = softcap * (1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)) * 1.4426950408889634
    elif MASKED or HAS_ALIBI:
        sc = sc * qk_scale
    if HAS_ALIBI:
        sc += slope[:, None] * (tok[None, :] - pos[:, None]).to(tl.float32)
    if MASKED:
        keep = valid[None, :] & (tok[None, :] <= pos[:, None])
        if HAS_WINDOW:  # transformers: kv > q - W
            keep = keep & (tok[None, :] > pos[:, None] - window)
        if HAS_CHUNK:  # transformers: same chunk, counted from the first (non-padding) key
            keep = keep & ((tok[None, :] - kv_lo) // chunk == tl.maximum(pos[:, None] - kv_lo, 0) // chunk)
        sc = tl.where(keep, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(sc - m_use[:, None])
    elif HAS_SOFTCAP or HAS_ALIBI:
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_use = m_new
        p = tl.math.exp2(sc - m_use[:, None])
    else:  # the scale joins the exponent's subtraction: the largest scaled score is the scaled largest (scale > 0)
        m_new = tl.maximum(m_i, tl.max(sc, 1) * qk_scale)
        m_use = m_new
        p = tl.math.exp2(sc * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + blk[:, None] * stride_vb + off[:, None] * stride_vt + offs_dv[None, :]  # [BLOCK_N, DV_PAD]
    if MASKED:
        v = tl.load(v_ptrs, mask=_dim_mask(valid[:, None], offs_dv[None, :], HEAD_DIM_V, DV_PAD), other=0.0)
    elif DV_PAD != HEAD_DIM_V:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
    else:
        v = tl.load(v_ptrs)
    v = v.to(q.dtype)
    if DOT_F32:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    elif IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# The mean query length of a step (tokens per sequence) from which a head dim above 64 reads whole key tiles unmasked.
WHOLE_TILES_MEAN_QUERY = 512


def _whole_tiles(head_dim: int, mean_query: float, chunked: bool) -> bool:
    """Whether a launch reads the key tiles that every row of a query tile sees whole without masks (`WHOLE`).

    Why: in a long prompt all but the diagonal key tiles are whole, and at head dim 64 the softmax's per-element work
    (the causal test, the -inf guards, the bounds of the loads) sets the pace more than the two products. Measured
    on the H100, kernel alone (`benchmarks/results/h100_2026-11-27c/`): long prompts +27-35 % at head dim 64, +14-17 %
    at 128, +8 % at 256; ShareGPT-like short prompts +4-5 % at 64 but 5-12 % slower at 96-256, where the longer code
    spills registers for few whole tiles. So a head dim above 64 takes it only for steps of long queries. A
    chunked-attention layer (llama4) never does: its chunk boundaries cut tiles anywhere."""
    return not chunked and (padded_dim(head_dim) <= 64 or mean_query >= WHOLE_TILES_MEAN_QUERY)


def _shared_memory() -> int:
    """`_device_shared_memory` of the current device; 0 without CUDA (only a test asks then, for a GPU's tile)."""
    return _device_shared_memory(torch.cuda.current_device()) if torch.cuda.is_available() else 0


@functools.cache
def _device_shared_memory(device_index: int) -> int:
    """Bytes of shared memory one program may opt into on the device (0 where torch does not say)."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


def _config(G: int, D: int, max_seqlen_q: int, on_cuda: bool, elem_bytes: int = 2):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), by the head dim's padded tile width and the element size.

    Measured on the H100 for 16-bit types (`benchmarks/results/h100_2026-11-27b/`, CUDA-graph timed on 16k-token
    chunks of long prompts, of ShareGPT-like prompts and of prompts continued after 2-8k cached keys): against the
    earlier table (8 warps from 128 x 128 tiles, 2 stages, 64 x 32 tiles at head dim 256) head dim 64 gains 12-23 %
    with 8 warps at 128 query rows, head dim 128 (and 96, padded) 13-28 % with 4 warps and 3 stages, and head dim 256
    65-135 % with 128 x 64 tiles in 8 warps. That tile needs ~192 KB of shared memory: on a GPU with less (an A100 has
    164 KB) head dim 256 keeps 64 query rows, in 4 warps (1.7x the earlier 8 on the H100). Float32 tiles take twice
    the shared memory (the 3-stage head dim 128 one would not fit an H100's): they keep the earlier table."""
    D = padded_dim(D)
    need = max(16, triton.next_power_of_2(G * max(1, max_seqlen_q)))
    if not on_cuda or elem_bytes > 2:  # the interpreter (fewer, larger steps are faster) and float32
        cap_m = 64 if D >= 256 or not on_cuda else 128
        block_m = max(min(cap_m, need), triton.next_power_of_2(G), 16)
        return block_m, 32 if D >= 256 else 64, 8 if block_m * D >= 128 * 128 else 4, 2
    if D > 256:  # the latent of multi-head latent attention (576, `checks.TRITON_MAX_WIDE_HEAD_DIM`): small tiles fit
        # (H200, bf16, 16 query heads, 812 query rows: (32, 32, 8, 1) 0.219 ms, (16, 32, 8, 2) 0.232, (16, 16, 4, 1)
        # 0.256; the default tiles need 786 KB of shared memory)
        return max(min(32, need), triton.next_power_of_2(G), 16), 32, 8, 1
    cap_m = 64 if D >= 256 and _shared_memory() < 200 * 1024 else 128
    block_m = max(min(cap_m, need), triton.next_power_of_2(G), 16)
    wide = block_m >= 128
    if D <= 64:
        return block_m, 64, 8 if wide else 4, 2
    if D <= 128:
        return block_m, 64, 4, 3 if wide else 2
    return (block_m, 64, 8, 2) if wide else (block_m, 32, 4, 2)


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
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the prefill kernel. Inputs are assumed validated (see ``hf_paged.kernels``)."""
    T, Hq, D = query.shape
    _, Hkv, bs, _ = key_cache.shape
    Dv = value_cache.shape[-1]
    S = seq_lens.shape[0]
    G = Hq // Hkv
    out = query.new_zeros(T, Hq, Dv)  # rows outside every sequence stay zero
    if T == 0 or S == 0 or max_seqlen_q <= 0:
        return out
    bm, bn, nw, ns = _config(G, D, max_seqlen_q, query.is_cuda, query.element_size())
    block_m = block_m or bm
    block_n = block_n or bn
    num_warps = num_warps or nw
    num_stages = num_stages or ns
    block_q = max(1, block_m // G)
    has_kv_start = kv_start is not None
    grid = (triton.cdiv(max_seqlen_q, block_q), Hkv, S)
    _paged_prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        kv_start if has_kv_start else seq_lens,
        out,
        sinks if sinks is not None else out,
        alibi_slopes if alibi_slopes is not None else out,
        k_scale if k_scale is not None else seq_lens,
        v_scale if v_scale is not None else seq_lens,
        float(scale) * _LOG2E,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
        int(chunk_size) if chunk_size is not None else 1,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale_stride(k_scale),
        G=G,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=D,
        HEAD_DIM_V=Dv,
        D_PAD=padded_dim(D),
        DV_PAD=padded_dim(Dv),
        BLOCK_SIZE=bs,
        BLOCK_N=block_n,
        HAS_KV_START=has_kv_start,
        HAS_WINDOW=sliding_window is not None,
        HAS_CHUNK=chunk_size is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        HAS_ALIBI=alibi_slopes is not None,
        IEEE=query.dtype == torch.float32,
        DOT_F32=not query.is_cuda,
        WHOLE=_whole_tiles(D, T / S, chunk_size is not None),
        QUANT=k_scale is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
