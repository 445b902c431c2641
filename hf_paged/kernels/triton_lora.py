"""Multi-LoRA delta in Triton: a gathered shrink then a gathered expand (Punica's BGMV), each token reading its own
adapter's rows of the stacked pool.

Two launches, no host sync (safe under CUDA-graph capture), buffers sized from shapes alone:

1. ``_shrink_kernel``: one program per (token, tile of ``BLOCK_R`` rank rows). It reads the token's slot, returns
   zeros for a token without an adapter (slot outside ``[0, L)``), else accumulates ``x_t . a[slot, r, :]`` in float32
   over ``BLOCK_K`` columns of the input at a time. The ``[T, R]`` result stays in float32.
2. ``_expand_kernel``: one program per (token, tile of ``BLOCK_N`` output columns): ``sum_r s[t, r] * b[slot, n, r]``
   over the whole (small, padded) rank in one tile, stored in the input dtype; zeros without an adapter.

Why per token and not segmented (SGMV): a decode step's tokens are one per sequence, so a token's adapter rows are
read once per token either way, and the per-token form needs no sort of the tokens by adapter (a sort is a launch,
and a segment table that CUDA graphs would have to keep static). A long prefill chunk of one adapter re-reads its
rows once per token from L2 (``R * (in + out)`` elements, small); segments would share them, which is what is left
to win for prefill-heavy traffic. Float32 inputs use IEEE products (no TF32). Imported lazily by
:mod:`hf_paged.kernels.lora` (needs triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["lora_delta"]


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, s_ptr, num_slots, rank, width, stride_x, stride_al, stride_ar,
                   stride_ak, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(idx_ptr + t).to(tl.int64)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if (slot >= 0) & (slot < num_slots):
        cols = tl.arange(0, BLOCK_K)
        for k in range(0, width, BLOCK_K):
            kk = k + cols
            xv = tl.load(x_ptr + t * stride_x + kk, mask=kk < width, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + slot * stride_al + rows[:, None] * stride_ar + kk[None, :] * stride_ak,
                         mask=(rows[:, None] < rank) & (kk[None, :] < width), other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(s_ptr + t * rank + rows, acc, mask=rows < rank)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, idx_ptr, out_ptr, num_slots, rank, out_features, stride_bl, stride_bn, stride_br,
                   stride_out, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(idx_ptr + t).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if (slot >= 0) & (slot < num_slots):
        rr = tl.arange(0, BLOCK_R)
        sv = tl.load(s_ptr + t * rank + rr, mask=rr < rank, other=0.0)
        bv = tl.load(b_ptr + slot * stride_bl + cols[:, None] * stride_bn + rr[None, :] * stride_br,
                     mask=(cols[:, None] < out_features) & (rr[None, :] < rank), other=0.0).to(tl.float32)
        acc = tl.sum(bv * sv[None, :], axis=1)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < out_features)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[T, out]`` in ``x``'s dtype (see the module docstring); ``x`` has unit stride in its last dim."""
    tokens, width = x.shape
    slots, rank, _ = a.shape
    out_features = b.shape[1]
    shrunk = torch.empty((tokens, rank), dtype=torch.float32, device=x.device)
    out = torch.empty((tokens, out_features), dtype=x.dtype, device=x.device)
    block_r = min(triton.next_power_of_2(rank), 64)
    block_k = max(16, min(256, triton.next_power_of_2(width), 4096 // block_r))
    _shrink_kernel[(tokens, triton.cdiv(rank, block_r))](
        x, a, index, shrunk, slots, rank, width, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        BLOCK_R=block_r, BLOCK_K=block_k)
    full_r = triton.next_power_of_2(rank)
    block_n = max(16, min(128, 8192 // full_r, triton.next_power_of_2(out_features)))
    _expand_kernel[(tokens, triton.cdiv(out_features, block_n))](
        shrunk, b, index, out, slots, rank, out_features, b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        BLOCK_N=block_n, BLOCK_R=full_r)
    return out
