"""Triton: one decode token of Mamba 2 on states kept in slots, each state read once and written once, in place.

Imported lazily by :mod:`hf_paged.kernels.mamba2_decode` (needs triton), which gives the contract and the roundings.
One program per (row, head, block of `head_dim`): the block's state tile `[BP, state_size]` of the row's slot is
loaded in float32, decayed and updated, stored back, and reduced against C for the output. The model-dtype roundings
of transformers' torch code are cast round trips (`_round`); in float32 they are no-ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import _last_contig


@triton.jit
def _round(v, dtype: tl.constexpr):
    """`v` rounded to `dtype` (where transformers' torch code holds a value in the model's dtype), as float32. To
    bfloat16 by integer arithmetic, to nearest even as torch and CUDA's cast round: Triton's interpreter truncates
    (Triton 3.9), and the tests run this kernel there."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _mamba2_decode_kernel(
    X, DT, A, B, C, D, DT_BIAS, STATE, SLOTS, Y,
    stride_xb, stride_xh, stride_dtb, stride_bb, stride_bg, stride_cb, stride_cg,
    stride_ss, stride_sh, stride_sp, stride_yb, stride_yh,
    REPEAT: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    ROUND_SKIP: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    low = X.dtype.element_ty
    g = h // REPEAT
    offs_p = pb * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mask_p = offs_p < P
    mask_n = offs_n < N
    x = tl.load(X + r * stride_xb + h * stride_xh + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    bias = _round(tl.load(DT_BIAS + h).to(tl.float32), low)
    v = _round(tl.load(DT + r * stride_dtb + h).to(tl.float32) + bias, low)
    # torch's softplus (threshold 20), log1p(e) by Kahan's log(w) * e / (w - 1): exact where 1 + e rounds
    e = tl.exp(tl.minimum(v, 20.0))
    w = 1.0 + e
    soft = tl.where(v > 20.0, v, tl.where(w == 1.0, e, tl.log(w) * e / tl.where(w == 1.0, 1.0, w - 1.0)))
    step = _round(soft, low)
    decay = tl.exp(step * tl.load(A + h).to(tl.float32))
    bvec = tl.load(B + r * stride_bb + g * stride_bg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    cvec = tl.load(C + r * stride_cb + g * stride_cg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    dbx = _round(_round(step * bvec, low)[None, :] * x[:, None], low)  # [BP, BN]
    slot = tl.load(SLOTS + r).to(tl.int64)
    ptrs = STATE + slot * stride_ss + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :]
    mask = mask_p[:, None] & mask_n[None, :]
    new = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * decay + dbx
    tl.store(ptrs, _round(new, STATE.dtype.element_ty).to(STATE.dtype.element_ty), mask=mask)
    out = _round(tl.sum(_round(new, low) * cvec[None, :], axis=1), low)
    skip = x * tl.load(D + h).to(tl.float32)
    if ROUND_SKIP:
        skip = _round(skip, low)
    tl.store(Y + r * stride_yb + h * stride_yh + offs_p, _round(out + skip, low).to(Y.dtype.element_ty), mask=mask_p)


def mamba2_decode(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                  d: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    rows, heads, dim = x.shape
    groups, size = b.shape[1:]
    out = x.new_empty(rows, heads, dim)
    if rows == 0:
        return out
    if state.stride(-1) != 1:  # updated in place: a contiguous copy would lose the update
        raise ValueError("mamba2_decode: state must be contiguous in its last dimension")
    bn = triton.next_power_of_2(size)
    # a [BP, BN] fp32 tile of 16 KiB at most (two live: the state and `dt * B * x`), more programs than heads x rows
    bp = min(triton.next_power_of_2(dim), max(16, 4096 // bn))
    x, dt, b, c = (_last_contig(t) for t in (x, dt, b, c))
    a, d, dt_bias, slots = (t.contiguous() for t in (a, d, dt_bias, slots))
    # transformers' `x * D` stays in the model's dtype when D's dtype promotes to it (else float32)
    round_skip = torch.promote_types(x.dtype, d.dtype) != torch.float32
    grid = (rows, heads, triton.cdiv(dim, bp))
    _mamba2_decode_kernel[grid](
        x, dt, a, b, c, d, dt_bias, state, slots, out,
        x.stride(0), x.stride(1), dt.stride(0), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        REPEAT=heads // groups, P=dim, N=size, BP=bp, BN=bn, ROUND_SKIP=round_skip, num_warps=4,
    )
    return out
