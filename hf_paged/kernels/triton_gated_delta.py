"""Triton: one decode step of the gated delta rule on states kept in slots (hybrid models' gated DeltaNet layers).

Imported lazily by :mod:`hf_paged.kernels.gated_delta` (needs triton). The state of each row is read from its slot,
updated and written back in place, once: flash-linear-attention's recurrent kernel reads an initial state and writes a
final state into a new tensor, so slotted states would be gathered before it and scattered after it (six passes over
the largest tensor of a hybrid model's decode step instead of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import _last_contig


@triton.jit
def _gdn_decode_kernel(
    Q, K, V, G, BETA, STATE, SLOTS, O,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_bb,
    stride_ss, stride_sh, stride_sk, stride_ob, stride_oh,
    scale, eps,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    g = tl.load(G + b * stride_gb + h).to(tl.float32)
    beta = tl.load(BETA + b * stride_bb + h).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    q = q * scale
    slot = tl.load(SLOTS + b).to(tl.int64)
    ptrs = STATE + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    state = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * tl.exp(g)
    memory = tl.sum(state * k[:, None], axis=0)
    delta = (v - memory) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(ptrs, state.to(STATE.dtype.element_ty), mask=mask)
    tl.store(O + b * stride_ob + h * stride_oh + offs_v, out.to(O.dtype.element_ty), mask=mask_v)


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, scale: float, use_l2norm: bool) -> torch.Tensor:
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    out = v.new_empty(rows, heads, dv)
    if rows == 0:
        return out
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 8192 // bk))  # a [BK, BV] fp32 tile: 32 KiB at most
    if state.stride(-1) != 1:  # updated in place: a contiguous copy would lose the update
        raise ValueError("gdn_decode: state must be contiguous in its last dimension")
    state_l = state
    q, k, v = (_last_contig(t) for t in (q, k, v))
    grid = (rows, heads, triton.cdiv(dv, bv))
    _gdn_decode_kernel[grid](
        q, k, v, g, beta, state_l, slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state_l.stride(0), state_l.stride(1), state_l.stride(2), out.stride(0), out.stride(1),
        float(scale), 1e-6, DK=dk, DV=dv, BK=bk, BV=bv, L2NORM=use_l2norm, num_warps=4,
    )
    return out
