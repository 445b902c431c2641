"""Paged varlen causal prefill for heads wider than 256 values (MLA's 576-value latent, Gemma 4's 512):
`triton_wide` says how a wide head is computed and why it has kernels of its own.

The same contract as `triton_prefill`: grid ``(q_tiles, Hkv * head_blocks, S)``. A program's ``BLOCK_M`` rows are
``BLOCK_Q`` query tokens x ``GB`` query heads of one KV head: the whole group (``GB = G``) when it fits the rows, so
each key tile serves several tokens; else ``BLOCK_M`` heads of one token (``BLOCK_Q = 1``, MLA's 16-128 heads per KV
head), the group over several head-block programs. Every key tile is read with masks (the narrow kernel's unmasked
whole tiles are not worth their registers here). Options: kv_start, sliding window, chunked attention, softcap,
sinks, ALiBi, an FP8 cache.

Launch tiles (`_config`), in 16-bit types: 32 rows x 32 keys in 8 warps, one stage (a ``[512, 32]`` key tile, the rest
and a ``[32, 512]`` value tile: about 80 KB of shared memory; the accumulator 64 floats a thread); 16 x 16 for values
over 512, a key rest over 128 or float32. Not yet timed on a GPU.

Imported lazily by :mod:`hf_paged.kernels` (needs triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention_end import _normalise
from .triton_cache import scale_stride
from .triton_dims import _dim_mask, padded_dim
from .triton_wide import _base2_logits, _load_query, _wide_pv, _wide_qk, key_split, values_are_keys

_LOG2E = 1.4426950408889634


def _config(G: int, D: int, max_seqlen_q: int, on_cuda: bool, elem_bytes: int = 2, Dv: int | None = None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a wide head (see the module docstring); `triton_prefill._config`'s
    signature, so the kernels' warm-up helpers ask either alike. They do not know the value width: without `Dv`, the
    values are taken to be at most 512 wide (MLA's latent, Gemma 4's heads)."""
    _, dt = key_split(D)
    small = padded_dim(Dv or min(D, 512)) > 512 or dt > 128 or elem_bytes > 2
    cap = 16 if small else 32
    block_m = min(cap, max(16, triton.next_power_of_2(G * max(1, max_seqlen_q))))
    return (block_m, 16, 8, 1) if small else (block_m, 32, 8, 1)


def _whole_tiles(head_dim: int, mean_query: float, chunked: bool) -> bool:
    """Never: the wide kernel reads every key tile masked (`triton_prefill._whole_tiles`' signature)."""
    return False


@triton.jit(do_not_specialize=["stride_btb"])
def _paged_prefill_wide_kernel(
        Q, KC, VC, BT, CU, SEQ, KVS, OUT, SINK, ALIBI, KS, VS, qk_scale, sm_scale, softcap, window, chunk,
        stride_qt, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_btb,
        stride_ot, stride_oh, stride_s,
        G: tl.constexpr, GB: tl.constexpr, NUM_HB: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, DM: tl.constexpr, DT: tl.constexpr, HAS_TAIL: tl.constexpr,
        DV_PAD: tl.constexpr, SHARED_V: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_KV_START: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        HAS_SINKS: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
        QUANT: tl.constexpr):
    qt = tl.num_programs(0) - 1 - tl.program_id(0)  # heavy (late) tiles first, as in `triton_prefill`
    kvh = tl.program_id(1) // NUM_HB
    hb = tl.program_id(1) % NUM_HB
    s = tl.program_id(2)
    q_start = tl.load(CU + s).to(tl.int32)
    q_len = tl.load(CU + s + 1).to(tl.int32) - q_start
    if qt * BLOCK_Q < q_len:
        seq_len = tl.load(SEQ + s).to(tl.int32)
        kv_lo = 0
        if HAS_KV_START:
            kv_lo = tl.maximum(tl.load(KVS + s).to(tl.int32), 0)
        ctx = seq_len - q_len  # position of query row 0
        offs_m = tl.arange(0, BLOCK_M)
        offs_km = tl.arange(0, DM)
        offs_kt = DM + tl.arange(0, DT)
        offs_dv = tl.arange(0, DV_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        tq = qt * BLOCK_Q + offs_m // GB  # query token index within the sequence
        g = hb * GB + offs_m % GB
        head = kvh * G + g
        row_ok = (offs_m < BLOCK_Q * GB) & (tq < q_len) & (g < G)
        pos = ctx + tq
        rows = (q_start + tq).to(tl.int64)
        q_m, q_t = _load_query(Q, rows * stride_qt + head * stride_qh, row_ok, offs_km, offs_kt, HEAD_DIM, DM, DT,
                               HAS_TAIL)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
        if HAS_ALIBI:  # each row's head's slope, in base 2 (the logits are scaled by log2(e))
            slope = tl.load(ALIBI + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        hi = tl.minimum(ctx + tl.minimum((qt + 1) * BLOCK_Q, q_len), seq_len)  # last key any row sees (+1)
        bt_row = BT + s.to(tl.int64) * stride_btb
        k_base = KC + kvh.to(tl.int64) * stride_kh
        v_base = VC + kvh.to(tl.int64) * stride_vh
        if QUANT:  # an FP8 cache: q . (k * ks) = ks * (q . k), so the key scale joins the logit scale
            ks = tl.load(KS + kvh * stride_s)
            qk_scale = qk_scale * ks
            sm_scale = sm_scale * ks
        lo_tile = kv_lo  # first key any row may see: a window / chunk raises it, blocks before it are never read
        pos0 = ctx + qt * BLOCK_Q
        if HAS_WINDOW:
            lo_tile = tl.maximum(lo_tile, pos0 - window + 1)
        if HAS_CHUNK:
            lo_tile = tl.maximum(lo_tile, kv_lo + (tl.maximum(pos0 - kv_lo, 0) // chunk) * chunk)
        for t0 in range((lo_tile // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            tok = t0 + offs_n
            valid = (tok >= lo_tile) & (tok < hi)
            blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            off = tok % BLOCK_SIZE
            sc, k_m = _wide_qk(q_m, q_t, k_base, blk, off, valid, stride_kb, stride_kt, offs_km, offs_kt, HEAD_DIM,
                               DM, DT, HAS_TAIL, DOT_F32, IEEE)
            sc = _base2_logits(sc, qk_scale, sm_scale, softcap, HAS_SOFTCAP)
            if HAS_ALIBI:
                sc += slope[:, None] * (tok[None, :] - pos[:, None]).to(tl.float32)
            keep = valid[None, :] & (tok[None, :] <= pos[:, None])
            if HAS_WINDOW:  # transformers: kv > q - W
                keep = keep & (tok[None, :] > pos[:, None] - window)
            if HAS_CHUNK:  # transformers: same chunk, counted from the first (non-padding) key
                keep = keep & ((tok[None, :] - kv_lo) // chunk == tl.maximum(pos[:, None] - kv_lo, 0) // chunk)
            sc = tl.where(keep, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(sc - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = _wide_pv(p, k_m, v_base, blk, off, valid, stride_vb, stride_vt, offs_dv, HEAD_DIM_V, DV_PAD,
                          SHARED_V, DOT_F32, IEEE)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if QUANT:  # sum p (v * vs) = vs * sum p v
            acc = acc * tl.load(VS + kvh * stride_s)
        o = _normalise(acc, m_i, l_i, SINK, head, row_ok, HAS_SINKS)
        tl.store(OUT + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                 o.to(OUT.dtype.element_ty), mask=_dim_mask(row_ok[:, None], offs_dv[None, :], HEAD_DIM_V, DV_PAD))


def paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seqlen_q: int,
                  kv_start: torch.Tensor | None = None, *, block_m: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, sliding_window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None, chunk_size: int | None = None,
                  alibi_slopes: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`triton_prefill.paged_prefill` for wide heads (same arguments, same result). Inputs are assumed validated."""
    T, Hq, D = query.shape
    _, Hkv, bs, _ = key_cache.shape
    Dv = value_cache.shape[-1]
    S = seq_lens.shape[0]
    G = Hq // Hkv
    out = query.new_zeros(T, Hq, Dv)  # rows outside every sequence stay zero
    if T == 0 or S == 0 or max_seqlen_q <= 0:
        return out
    bm, bn, nw, ns = _config(G, D, max_seqlen_q, query.is_cuda, query.element_size(), Dv)
    block_m = block_m or bm
    gb = min(G, block_m)  # query heads of one KV head per program
    num_hb = triton.cdiv(G, gb)
    block_q = max(1, block_m // gb)
    dm, dt = key_split(D)
    _paged_prefill_wide_kernel[(triton.cdiv(max_seqlen_q, block_q), Hkv * num_hb, S)](
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
        kv_start if kv_start is not None else seq_lens, out, sinks if sinks is not None else out,
        alibi_slopes if alibi_slopes is not None else out, k_scale if k_scale is not None else seq_lens,
        v_scale if v_scale is not None else seq_lens, float(scale) * _LOG2E, float(scale),
        float(softcap) if softcap is not None else 1.0, int(sliding_window) if sliding_window is not None else 0,
        int(chunk_size) if chunk_size is not None else 1, query.stride(0), query.stride(1), *key_cache.stride()[:3],
        *value_cache.stride()[:3], block_tables.stride(0), out.stride(0), out.stride(1), scale_stride(k_scale),
        G=G, GB=gb, NUM_HB=num_hb, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=D, HEAD_DIM_V=Dv, DM=dm,
        DT=max(dt, 16), HAS_TAIL=dt > 0, DV_PAD=padded_dim(Dv), SHARED_V=values_are_keys(key_cache, value_cache),
        BLOCK_SIZE=bs, BLOCK_N=block_n or bn, HAS_KV_START=kv_start is not None,
        HAS_WINDOW=sliding_window is not None, HAS_CHUNK=chunk_size is not None, HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, HAS_ALIBI=alibi_slopes is not None, IEEE=query.dtype == torch.float32,
        DOT_F32=not query.is_cuda, QUANT=k_scale is not None, num_warps=num_warps or nw, num_stages=num_stages or ns,
    )
    return out
