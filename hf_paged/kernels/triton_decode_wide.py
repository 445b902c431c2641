"""Paged decode attention for heads wider than 256 values (MLA's 576-value latent, Gemma 4's 512): `triton_wide`
says how a wide head is computed and why it has kernels of its own.

The same contract and split rule as `triton_decode` (whose module docstring says why the cut is path-invariant):
grid ``(num_splits, B, Hkv * head_blocks)``, each program one split of one sequence's keys for at most ``BLOCK_H``
query heads of one KV head. With one head block (``G <= BLOCK_H``) split counters combine the splits inside the
kernel as in `triton_decode`; with several, a separate combine kernel runs (the counters count one program per
(sequence, KV head)), and the counters are left untouched at zero. Every head-block program that reads the step's
own position writes the step's K/V (the same bytes), so none reads the slot before its own write.

Options: kv_start, sliding window, chunked attention, softcap, sinks, ALiBi, an FP8 cache (converted as
`triton_fp8.READ_MODE` says; its "_t" variants are read as the plain ones), the fused K/V write.
Launch tiles (`_config`): BLOCK_H 16 query heads, BLOCK_N 32 keys, 2 stages (vLLM's grouped MLA decode tile): a
``[512, 32]`` key tile, the 64-wide rest and a ``[32, 512]`` value tile, double-buffered, take about 140 KB of shared
memory in 16-bit types, inside an H100/H200's 227 KB. 8 warps, not vLLM's 4: the ``16 x 512`` float32 accumulator,
the query and a key tile kept for the values come near 255 registers a thread in 4 (the MLA helper's padded
1,024-lane tile spilled at 4 warps on the H200, 9x slower, and was fastest at 32 keys / 8 warps / 2 stages). Wider
values (> 512), a wider key rest (> 128) or float32 take 16 keys. Not yet timed on a GPU
(`benchmarks/bench_decode_kernel.py --shapes wide --sweep`).

Imported lazily by :mod:`hf_paged.kernels` (needs triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_decode
from .triton_attention_end import _combine_splits, _write_output
from .triton_cache import scale_stride
from .triton_decode import _LOG2E, MIN_TOKENS_PER_SPLIT, _launch_splits
from .triton_dims import _dim_mask, padded_dim
from .triton_fp8 import _abs_max, _fp8_end, _fp8_probs, _fp8_query, _query_scale, _to_cache, read_mode
from .triton_wide import _base2_logits, _load_query, _wide_pv, _wide_qk, key_split, values_are_keys

BLOCK_H = 16  # query heads per program: tl.dot's least rows; more heads per KV head take more head blocks


def _config(d: int, dv: int, elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps, num_stages) for a wide head: see the module docstring."""
    _, dt = key_split(d)
    small = padded_dim(dv) > 512 or dt > 128 or elem_bytes > 2
    return (BLOCK_H, 16, 8, 2) if small else (BLOCK_H, 32, 8, 2)


def default_num_splits(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int,
                       max_context: int, device) -> int:
    """The split count `paged_decode` picks when not told; head blocks count as KV heads of the grid."""
    _, block_n, _, _ = _config(head_dim, head_dim_v)
    programs = num_kv_heads * triton.cdiv(num_q_heads // num_kv_heads, BLOCK_H)
    return _launch_splits(triton_decode.FORCE_NUM_SPLITS, batch, programs, max_context, block_n, device)


def launch_variant(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int,
                   max_context: int, device) -> tuple:
    """As `triton_decode.launch_variant`: a key equal for two default launches that run the same compiled kernels."""
    splits = default_num_splits(batch, num_q_heads, num_kv_heads, head_dim, head_dim_v, max_context, device)
    if splits == 1:
        return (False, False)
    ints = (num_q_heads * splits * head_dim_v, splits * head_dim_v, num_q_heads * splits, splits)
    return (True, False) + tuple((v == 1, v % 16 == 0) for v in ints)


@triton.jit(do_not_specialize=["stride_btb"])
def _paged_decode_wide_kernel(
        Q, KC, VC, BT, SEQ, KVS, OUT, PACC, PM, PL, SINK, ALIBI, KNEW, VNEW, SLOT, CNT, KS, VS,
        qk_scale, sm_scale, softcap, window, chunk,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_btb,
        stride_ob, stride_oh, stride_pab, stride_pah, stride_pas, stride_pmb, stride_pmh,
        stride_knb, stride_knh, stride_vnb, stride_vnh, stride_s,
        G: tl.constexpr, BLOCK_H: tl.constexpr, NUM_HB: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_V: tl.constexpr, DM: tl.constexpr, DT: tl.constexpr, HAS_TAIL: tl.constexpr, DV_PAD: tl.constexpr,
        SHARED_V: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_KV_START: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
        HAS_ALIBI: tl.constexpr, SPLIT: tl.constexpr, MIN_SPLIT: tl.constexpr, IEEE: tl.constexpr,
        DOT_F32: tl.constexpr, WRITE: tl.constexpr, FUSE_REDUCE: tl.constexpr, QUANT: tl.constexpr,
        SOFT_FP8: tl.constexpr, READ: tl.constexpr):
    sp = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_HB
    hb = tl.program_id(2) % NUM_HB

    seq_len = tl.load(SEQ + b).to(tl.int32)
    kv_lo = 0
    if HAS_KV_START:
        kv_lo = tl.load(KVS + b).to(tl.int32)
    if HAS_WINDOW:  # the query sits at seq_len - 1: a window / chunk only raises the first key
        kv_lo = tl.maximum(kv_lo, seq_len - window)
    if HAS_CHUNK:
        kv_lo = kv_lo + (tl.maximum(seq_len - 1 - kv_lo, 0) // chunk) * chunk
    lo = kv_lo
    hi = seq_len
    parts = 1
    if SPLIT:  # the sequence's own keys in whole tiles, as `triton_decode` cuts them
        base = (kv_lo // BLOCK_N) * BLOCK_N
        span = tl.maximum(seq_len - base, 0)
        parts = tl.maximum(tl.minimum(tl.num_programs(0), tl.cdiv(span, MIN_SPLIT)), 1)
        per = tl.cdiv(tl.cdiv(span, parts), BLOCK_N) * BLOCK_N
        lo = tl.maximum(kv_lo, base + sp * per)
        hi = tl.minimum(seq_len, base + (sp + 1) * per)
    active = sp < parts
    if not FUSE_REDUCE:  # the combine kernel reads every split: the unused ones write empty partials
        active = sp >= 0
    if active:
        offs_h = tl.arange(0, BLOCK_H)
        offs_km = tl.arange(0, DM)
        offs_kt = DM + tl.arange(0, DT)
        offs_dv = tl.arange(0, DV_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        g = hb * BLOCK_H + offs_h
        gmask = g < G
        head = kvh * G + g
        b64 = b.to(tl.int64)
        q_m, q_t = _load_query(Q, b64 * stride_qb + head * stride_qh, gmask, offs_km, offs_kt, HEAD_DIM, DM, DT,
                               HAS_TAIL)
        ks = 1.0
        vs = 1.0
        if QUANT:  # an FP8 cache: this KV head's scales (one per head, or one for all: stride 0)
            ks = tl.load(KS + kvh * stride_s)
            vs = tl.load(VS + kvh * stride_s)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, DV_PAD], dtype=tl.float32)
        if HAS_ALIBI:  # slopes in base 2: the logits are scaled by log2(e)
            slope = tl.load(ALIBI + head, mask=gmask, other=0.0).to(tl.float32) * 1.4426950408889634
        bt_row = BT + b64 * stride_btb
        k_base = KC + kvh.to(tl.int64) * stride_kh
        v_base = VC + kvh.to(tl.int64) * stride_vh
        if WRITE:  # the step's own K/V, by every head block of the split that reads its position (same bytes)
            new_pos = seq_len - 1
            owner = ((new_pos >= lo) & (new_pos < hi)) | ((sp == 0) & (new_pos < kv_lo))
            slot = tl.load(SLOT + b).to(tl.int64)
            if owner & (slot >= 0):
                row_k = k_base + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt
                row_v = v_base + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt
                new_k = KNEW + b64 * stride_knb + kvh * stride_knh
                mm = offs_km < HEAD_DIM
                tl.store(row_k + offs_km, _to_cache(tl.load(new_k + offs_km, mask=mm), ks, QUANT, SOFT_FP8,
                                                    KC.dtype.element_ty), mask=mm)
                if HAS_TAIL:
                    mt = offs_kt < HEAD_DIM
                    tl.store(row_k + offs_kt, _to_cache(tl.load(new_k + offs_kt, mask=mt), ks, QUANT, SOFT_FP8,
                                                        KC.dtype.element_ty), mask=mt)
                dvm = offs_dv < HEAD_DIM_V
                v_new = tl.load(VNEW + b64 * stride_vnb + kvh * stride_vnh + offs_dv, mask=dvm)
                tl.store(row_v + offs_dv, _to_cache(v_new, vs, QUANT, SOFT_FP8, VC.dtype.element_ty), mask=dvm)
            tl.debug_barrier()  # the stores visible to the program's other threads before the loop reads them
        if QUANT:  # q . (k * ks) = ks * (q . k): the key scale joins the logit scale (with the read's factor)
            q_max = _abs_max(q_m)
            if HAS_TAIL:  # one multiplier for both parts of the query
                q_max = tl.maximum(q_max, _abs_max(q_t))
            q_mul, k_fac = _query_scale(q_max, READ)
            q_m = _fp8_query(q_m, q_mul, READ)
            q_t = _fp8_query(q_t, q_mul, READ)
            qk_scale = qk_scale * ks * k_fac
            sm_scale = sm_scale * ks * k_fac
        for t0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            tok = t0 + offs_n
            valid = (tok >= lo) & (tok < hi)
            blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            off = tok % BLOCK_SIZE
            s, k_m = _wide_qk(q_m, q_t, k_base, blk, off, valid, stride_kb, stride_kt, offs_km, offs_kt, HEAD_DIM,
                              DM, DT, HAS_TAIL, DOT_F32, IEEE, READ)
            s = _base2_logits(s, qk_scale, sm_scale, softcap, HAS_SOFTCAP)
            if HAS_ALIBI:  # slope * (key - query), the query at seq_len - 1
                s += slope[:, None] * (tok - seq_len + 1).to(tl.float32)[None, :]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = _fp8_probs(s, m_use, READ)  # exp2(s - m), scaled for a "bits" read
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = _wide_pv(p, k_m, v_base, blk, off, valid, stride_vb, stride_vt, offs_dv, HEAD_DIM_V, DV_PAD,
                          SHARED_V, DOT_F32, IEEE, READ)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if QUANT:  # sum p (v * vs) = vs * sum p v (and the read's factors)
            acc, l_i = _fp8_end(acc, l_i, vs, READ)
        direct = not SPLIT
        if SPLIT and FUSE_REDUCE:
            direct = parts == 1
        if direct:
            _write_output(acc, m_i, l_i, SINK, OUT, b64, head, gmask, offs_dv, stride_ob, stride_oh, HAS_SINKS,
                          HEAD_DIM_V, DV_PAD)
        else:
            pa = PACC + b64 * stride_pab + head[:, None] * stride_pah + sp * stride_pas + offs_dv[None, :]
            tl.store(pa, acc, mask=_dim_mask(gmask[:, None], offs_dv[None, :], HEAD_DIM_V, DV_PAD))
            pm = b64 * stride_pmb + head * stride_pmh + sp
            tl.store(PM + pm, m_i, mask=gmask)
            tl.store(PL + pm, l_i, mask=gmask)
            if FUSE_REDUCE:  # one head block only: the last split to finish combines (see `triton_decode`)
                tl.debug_barrier()
                counter = CNT + b * tl.num_programs(2) + kvh
                ticket = tl.atomic_add(counter, 1, sem="acq_rel")
                if ticket == parts - 1:
                    _combine_splits(PACC, PM, PL, SINK, OUT, b64, head, gmask, parts, stride_pab, stride_pah,
                                    stride_pas, stride_pmb, stride_pmh, stride_ob, stride_oh, HEAD_DIM_V, HAS_SINKS,
                                    DV_PAD)
                    tl.atomic_xchg(counter, 0)


@triton.jit
def _wide_reduce_kernel(PACC, PM, PL, SINK, OUT, num_splits, num_heads, stride_pab, stride_pah, stride_pas,
                        stride_pmb, stride_pmh, stride_ob, stride_oh, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                        HAS_SINKS: tl.constexpr, D_PAD: tl.constexpr):
    """Combine the split partials of `BLOCK_H` query heads of one sequence (`_combine_splits`, the narrow combine's
    helper: the same bits), so a wide group's combine holds ``BLOCK_H x D_PAD`` floats, not ``G x D_PAD``."""
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _combine_splits(PACC, PM, PL, SINK, OUT, tl.program_id(0).to(tl.int64), heads, heads < num_heads, num_splits,
                    stride_pab, stride_pah, stride_pas, stride_pmb, stride_pmh, stride_ob, stride_oh, HEAD_DIM,
                    HAS_SINKS, D_PAD)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, kv_start: torch.Tensor | None = None, *,
                 num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, max_context: int | None = None, out: torch.Tensor | None = None,
                 sliding_window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                 chunk_size: int | None = None, alibi_slopes: torch.Tensor | None = None,
                 new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 split_counters: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, block_h: int | None = None) -> torch.Tensor:
    """`triton_decode.paged_decode` for wide heads (same arguments, same result). Inputs are assumed validated.
    `block_h` (a power of two >= 16; sweeps): query heads per program, instead of `BLOCK_H`."""
    B, Hq, D = query.shape
    _, Hkv, bs, _ = key_cache.shape
    Dv = value_cache.shape[-1]
    G = Hq // Hkv
    if out is None:
        out = query.new_empty(B, Hq, Dv)
    if B == 0:
        return out
    cfg_h, cfg_n, cfg_w, cfg_s = _config(D, Dv, query.element_size())
    block_h = block_h or cfg_h
    block_n = block_n or cfg_n
    num_hb = triton.cdiv(G, block_h)
    if max_context is None:
        max_context = block_tables.shape[1] * bs
    if num_splits is None:  # the narrow kernel's override (tests, benchmarks) holds for both
        num_splits = triton_decode.FORCE_NUM_SPLITS
    min_split = block_n if num_splits is not None else MIN_TOKENS_PER_SPLIT
    num_splits = _launch_splits(num_splits, B, Hkv * num_hb, max_context, block_n, query.device)
    fuse_reduce = num_splits > 1 and split_counters is not None and num_hb == 1
    dm, dt = key_split(D)
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        new_strides = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1))
    else:
        k_new = v_new = slots = query  # unused
        new_strides = (0, 0, 0, 0)
    if num_splits > 1:
        pacc = torch.empty(B, Hq, num_splits, Dv, device=query.device, dtype=torch.float32)
        pm = torch.empty(B, Hq, num_splits, device=query.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        pstrides = (pacc.stride(0), pacc.stride(1), pacc.stride(2), pm.stride(0), pm.stride(1))
    else:
        pacc = pm = pl = out  # unused
        pstrides = (0, 0, 0, 0, 0)
    sink_arg = sinks if sinks is not None else out
    _paged_decode_wide_kernel[(num_splits, B, Hkv * num_hb)](
        query, key_cache, value_cache, block_tables, seq_lens, kv_start if kv_start is not None else seq_lens, out,
        pacc, pm, pl, sink_arg, alibi_slopes if alibi_slopes is not None else out,
        k_new, v_new, slots, split_counters if fuse_reduce else seq_lens,
        k_scale if k_scale is not None else seq_lens, v_scale if v_scale is not None else seq_lens,
        float(scale) * _LOG2E, float(scale), float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0, int(chunk_size) if chunk_size is not None else 1,
        query.stride(0), query.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1), *pstrides, *new_strides, scale_stride(k_scale),
        G=G, BLOCK_H=block_h, NUM_HB=num_hb, HEAD_DIM=D, HEAD_DIM_V=Dv, DM=dm, DT=max(dt, 16), HAS_TAIL=dt > 0,
        DV_PAD=padded_dim(Dv), SHARED_V=values_are_keys(key_cache, value_cache), BLOCK_SIZE=bs, BLOCK_N=block_n,
        HAS_KV_START=kv_start is not None, HAS_WINDOW=sliding_window is not None, HAS_CHUNK=chunk_size is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, HAS_ALIBI=alibi_slopes is not None,
        SPLIT=num_splits > 1, MIN_SPLIT=min_split, IEEE=query.dtype == torch.float32, DOT_F32=not query.is_cuda,
        WRITE=new_kv is not None, FUSE_REDUCE=fuse_reduce, QUANT=k_scale is not None,
        SOFT_FP8=k_scale is not None and not query.is_cuda,
        READ=read_mode(query.dtype, k_scale is not None, query.is_cuda)[0],
        num_warps=num_warps or cfg_w, num_stages=num_stages or cfg_s,
    )
    if num_splits > 1 and not fuse_reduce:
        _wide_reduce_kernel[(B, triton.cdiv(Hq, BLOCK_H))](
            pacc, pm, pl, sink_arg, out, num_splits, Hq, *pstrides, out.stride(0), out.stride(1),
            BLOCK_H=BLOCK_H, HEAD_DIM=Dv, HAS_SINKS=sinks is not None, D_PAD=padded_dim(Dv), num_warps=4,
        )
    return out
