"""Prototype: stream-K paged decode. A fixed grid of programs walks one flat list of (KV head, key tile) work, each
program a contiguous range, in one software-pipelined loop that crosses item boundaries. Items (sequence, KV head)
cut by a range boundary store partials; the last piece to finish combines them (in program order).

The per-step tile table (row and tile index of every tile, flags for an item's first/last tile) is built on the
host: `build_table`. Layers share it.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from hf_paged.kernels.triton_attention_end import _normalise

_LOG2E = 1.4426950408889634


def build_table(seq_lens, kv_start, block_n: int, device):
    """Host tile table for one step: TB [T] row of each tile, TJ [T] (tile index << 2 | first | last << 1),
    ROW0 [B] first tile of the row, ROWN [B] its tile count, NT [1] = T. Every row gets at least one tile (an empty
    range writes zeros and the step's K/V)."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    lo = np.asarray(kv_start, dtype=np.int64) if kv_start is not None else np.zeros_like(seq)
    lo_t = np.minimum(lo, np.maximum(seq - 1, 0)) // block_n
    hi_t = -(-seq // block_n)
    n = np.maximum(hi_t - lo_t, 1)
    row0 = np.concatenate([[0], np.cumsum(n)[:-1]])
    T = int(n.sum())
    tb = np.repeat(np.arange(len(seq)), n)
    j = np.arange(T) - np.repeat(row0, n) + np.repeat(lo_t, n)
    first = (np.arange(T) == np.repeat(row0, n)).astype(np.int64)
    last = (np.arange(T) == np.repeat(row0 + n - 1, n)).astype(np.int64)
    tj = j * 4 + first + 2 * last
    mk = lambda a: torch.tensor(a, dtype=torch.int32, device=device)  # noqa: E731
    return {"TB": mk(tb), "TJ": mk(tj), "ROW0": mk(row0), "ROWN": mk(n), "NT": mk([T])}


@triton.jit
def _bc(cond, like):
    """A scalar condition as a vector like `like` (the interpreter cannot mix them in a mask)."""
    return (tl.zeros_like(like) + cond.to(tl.int32)) != 0


@triton.jit
def _stream_decode_kernel(
    Q, KC, VC, BT, SEQ, KVS, OUT, PACC, PM, PL, SINK, KNEW, VNEW, SLOT, CNT,
    TB, TJ, ROW0, ROWN, NT,
    qk_scale, sm_scale, softcap, Hkv,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_btb,
    stride_ob, stride_oh, stride_knb, stride_knh, stride_vnb, stride_vnh,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_PER: tl.constexpr,
    HAS_KV_START: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    IEEE: tl.constexpr, DOT_F32: tl.constexpr, WRITE: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    T = tl.load(NT)
    total = T * Hkv
    per = tl.maximum(tl.cdiv(total, P), MIN_PER)
    f0 = pid * per
    f1 = tl.minimum(f0 + per, total)
    if f0 < f1:
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_dv = tl.arange(0, HEAD_DIM_V)
        offs_n = tl.arange(0, BLOCK_N)
        gmask = offs_g < G
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM_V], dtype=tl.float32)
        saw_first = pid < 0  # False, as a tensor
        for f in range(f0, f1):
            kvh = f // T
            t = f - kvh * T
            b = tl.load(TB + t)
            tj = tl.load(TJ + t)
            first = (tj & 1) != 0
            last = (tj & 2) != 0
            j = tj >> 2
            b64 = b.to(tl.int64)
            seq_len = tl.load(SEQ + b)
            if HAS_KV_START:
                lo = tl.load(KVS + b)
            else:
                lo = 0
            head = kvh * G + offs_g
            q = tl.load(Q + b64 * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None],
                        other=0.0)
            tok = j * BLOCK_N + offs_n
            valid = (tok >= lo) & (tok < seq_len)
            blk = tl.load(BT + b64 * stride_btb + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            off = tok % BLOCK_SIZE
            k_base = KC + kvh.to(tl.int64) * stride_kh
            v_base = VC + kvh.to(tl.int64) * stride_vh
            k = tl.load(k_base + blk[None, :] * stride_kb + off[None, :] * stride_kt + offs_d[:, None],
                        mask=valid[None, :], other=0.0)
            v = tl.load(v_base + blk[:, None] * stride_vb + off[:, None] * stride_vt + offs_dv[None, :],
                        mask=valid[:, None], other=0.0)
            if WRITE:
                slot = tl.load(SLOT + b).to(tl.int64)
                k_new = tl.load(KNEW + b64 * stride_knb + kvh * stride_knh + offs_d)
                v_new = tl.load(VNEW + b64 * stride_vnb + kvh * stride_vnh + offs_dv)
                is_new = (tok == seq_len - 1) & (slot >= 0)
                k = tl.where(is_new[None, :], k_new.to(k.dtype)[:, None], k)
                v = tl.where(is_new[:, None], v_new.to(v.dtype)[None, :], v)
                wr = last & (slot >= 0)
                blk_new = slot // BLOCK_SIZE
                off_new = slot % BLOCK_SIZE
                tl.store(k_base + blk_new * stride_kb + off_new * stride_kt + offs_d,
                         k_new.to(KC.dtype.element_ty), mask=_bc(wr, offs_d))
                tl.store(v_base + blk_new * stride_vb + off_new * stride_vt + offs_dv,
                         v_new.to(VC.dtype.element_ty), mask=_bc(wr, offs_dv))
            start_here = first | (f == f0)
            m_i = tl.where(start_here, float("-inf"), m_i)
            l_i = tl.where(start_here, 0.0, l_i)
            acc = tl.where(start_here, 0.0, acc)
            saw_first = tl.where(f == f0, first, saw_first | first)
            if DOT_F32:
                s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
            elif IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            if HAS_SOFTCAP:
                x = s * sm_scale / softcap
                s = softcap * (1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)) * 1.4426950408889634
            else:
                s = s * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DOT_F32:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            elif IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
            end_here = last | (f == f1 - 1)
            direct = last & saw_first
            o = _normalise(acc, m_i, l_i, SINK, head, gmask, HAS_SINKS)
            tl.store(OUT + b64 * stride_ob + head[:, None] * stride_oh + offs_dv[None, :],
                     o.to(OUT.dtype.element_ty), mask=gmask[:, None] & _bc(direct, offs_g)[:, None])
            part = end_here & (direct == 0)
            slot_p = saw_first.to(tl.int32)
            pbase = (pid * 2 + slot_p) * G_PAD
            tl.store(PACC + (pbase + offs_g)[:, None] * HEAD_DIM_V + offs_dv[None, :], acc,
                     mask=gmask[:, None] & _bc(part, offs_g)[:, None])
            tl.store(PM + pbase + offs_g, m_i, mask=gmask & _bc(part, offs_g))
            tl.store(PL + pbase + offs_g, l_i, mask=gmask & _bc(part, offs_g))
        # the cut items: the one holding f0 (if it began earlier), the one holding f1 - 1 (if it goes on)
        tl.debug_barrier()
        for which in tl.static_range(2):
            if which == 0:
                fe = f0
            else:
                fe = f1 - 1
            kvh = fe // T
            t = fe - kvh * T
            b = tl.load(TB + t)
            s_item = kvh * T + tl.load(ROW0 + b)
            e_item = s_item + tl.load(ROWN + b)
            if which == 0:
                cut = s_item < f0  # began in an earlier program
            else:
                cut = (e_item > f1) & (s_item >= f0)  # began here, goes on
            if cut:
                counter = CNT + b * Hkv + kvh
                q_lo = s_item // per
                q_hi = (e_item - 1) // per
                ticket = tl.atomic_add(counter, 1, sem="acq_rel")
                if ticket == q_hi - q_lo:
                    offs_g = tl.arange(0, G_PAD)
                    offs_dv = tl.arange(0, HEAD_DIM_V)
                    gmask = offs_g < G
                    head = kvh * G + offs_g
                    m_max = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
                    for qq in range(q_lo, q_hi + 1):
                        sl = (s_item >= qq * per).to(tl.int32)
                        pb = (qq * 2 + sl) * G_PAD
                        m_max = tl.maximum(m_max, tl.load(PM + pb + offs_g, mask=gmask, other=float("-inf"),
                                                          cache_modifier=".cg"))
                    if HAS_SINKS:
                        sink = tl.load(SINK + head, mask=gmask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
                        m_max = tl.maximum(m_max, sink)
                    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
                    l_tot = tl.zeros([G_PAD], dtype=tl.float32)
                    o = tl.zeros([G_PAD, HEAD_DIM_V], dtype=tl.float32)
                    for qq in range(q_lo, q_hi + 1):
                        sl = (s_item >= qq * per).to(tl.int32)
                        pb = (qq * 2 + sl) * G_PAD
                        w = tl.math.exp2(tl.load(PM + pb + offs_g, mask=gmask, other=float("-inf"),
                                                 cache_modifier=".cg") - m_use)
                        l_tot += tl.load(PL + pb + offs_g, mask=gmask, other=0.0, cache_modifier=".cg") * w
                        o += tl.load(PACC + (pb + offs_g)[:, None] * HEAD_DIM_V + offs_dv[None, :],
                                     mask=gmask[:, None], other=0.0, cache_modifier=".cg") * w[:, None]
                    if HAS_SINKS:
                        l_tot += tl.math.exp2(sink - m_use)
                    l_safe = tl.where(l_tot == 0.0, 1.0, l_tot)
                    o = o / l_safe[:, None]
                    tl.store(OUT + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_dv[None, :],
                             o.to(OUT.dtype.element_ty), mask=gmask[:, None])
                    tl.atomic_xchg(counter, 0)


PROGRAMS_PER_SM = 8
MIN_PER = 4
NUM_STAGES = 2
NUM_WARPS = 4
BLOCK_N = 64
_tables: dict = {}


def prepare(seq_lens_host, kv_start_host, device, block_n: int = None):
    """Build and keep the step's table (the harness calls this outside its timed graph)."""
    _tables["cur"] = build_table(seq_lens_host, kv_start_host, block_n or BLOCK_N, device)
    return _tables["cur"]


def paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, kv_start=None, *, max_context=None,
                 out=None, softcap=None, sinks=None, new_kv=None, split_counters=None, table=None,
                 programs_per_sm=None, min_per=None, num_stages=None, num_warps=None, block_n=None, **_):
    B, Hq, D = query.shape
    _, Hkv, bs, _ = key_cache.shape
    Dv = value_cache.shape[-1]
    G = Hq // Hkv
    g_pad = max(16, triton.next_power_of_2(G))
    if out is None:
        out = query.new_empty(B, Hq, Dv)
    table = table or _tables["cur"]
    if query.is_cuda:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    else:
        sms = 2
    P = sms * (programs_per_sm or PROGRAMS_PER_SM)
    pacc = torch.empty(P * 2 * g_pad, Dv, device=query.device, dtype=torch.float32)
    pm = torch.empty(P * 2 * g_pad, device=query.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        ns = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1))
    else:
        k_new = v_new = slots = query
        ns = (0, 0, 0, 0)
    cnt = split_counters
    _stream_decode_kernel[(P,)](
        query, key_cache, value_cache, block_tables, seq_lens, kv_start if kv_start is not None else seq_lens, out,
        pacc, pm, pl, sinks if sinks is not None else out, k_new, v_new, slots, cnt,
        table["TB"], table["TJ"], table["ROW0"], table["ROWN"], table["NT"],
        float(scale) * _LOG2E, float(scale), float(softcap) if softcap is not None else 1.0, Hkv,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), *ns,
        G=G, G_PAD=g_pad, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_SIZE=bs, BLOCK_N=block_n or BLOCK_N,
        MIN_PER=min_per or MIN_PER, HAS_KV_START=kv_start is not None, HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, IEEE=query.dtype == torch.float32, DOT_F32=not query.is_cuda,
        WRITE=new_kv is not None, num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES,
    )
    return out
