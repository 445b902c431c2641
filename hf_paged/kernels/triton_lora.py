"""Multi-LoRA delta in Triton: a shrink then an expand, each token through its own adapter's rows of the stacked
pool, in token tiles that read each adapter's weights once per tile (Punica's SGMV idea without a sort).

Two launches, no host sync (safe under CUDA-graph capture), buffers sized from shapes alone:

1. ``_shrink_kernel``: one program per (tile of ``BLOCK_M`` consecutive tokens, slot, run of input columns); a
   program whose slot no token of the tile uses returns at once, the others run their part of the tile's GEMM
   ``x_tile @ a[slot].T`` (``BLOCK_K`` input columns at a time, float32 accumulators) and store the rows of their
   slot's tokens. The ``[splits, T, R]`` partial products stay in float32; the rows of tokens without an adapter
   (slot outside ``[0, L)``) are never written, and never read. Why the runs (split-K): a decode step has few
   (tile, slot) programs, and without them each would read all input columns alone (`_splits`).
2. ``_expand_kernel``: one program per (token tile, ``BLOCK_N`` output columns): sums the partial products in run
   order (deterministic), then for each used slot,
   ``s_tile(rows of that slot) @ b[slot].T`` over the whole (small, padded) rank, summed, stored in the input dtype
   (zeros for tokens without an adapter). Why slots are a grid dimension of the shrink and a loop of the expand: the
   shrink reads ``R x in`` weights per slot, the expand ``BLOCK_N x R``; a decode step of 256 tokens has 4 tiles, and
   its shrink would otherwise run on 4 programs.

Why tiles and no sort: the tokens of a prefill chunk are consecutive and share their adapter, so a prefill tile uses
one slot and reads its weights once for ``BLOCK_M`` tokens (a per-token kernel, Punica's BGMV, reads them once per
token). A decode tile holds up to ``BLOCK_M`` sequences of several adapters: it reads each used adapter once, still
at most ``L`` reads per tile against ``BLOCK_M`` per-token reads. The products of a tile's other rows are computed and
dropped, which costs tensor-core time only. A sort of the tokens by adapter (SGMV's segments) would need a segment
table that CUDA graphs keep static and one more launch. Float32 inputs use IEEE products (no TF32); under the
interpreter every dot runs in float32 (its 16-bit dots into float32 accumulators are wrong). Imported lazily
by :mod:`hf_paged.kernels.lora` (needs triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import num_sms

__all__ = ["lora_delta"]


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    if DOT_F32:  # the interpreter (CPU tensors): its 16-bit dots into float32 accumulators are wrong
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, s_ptr, tokens, rank, width, span, stride_x, stride_al, stride_ar, stride_ak,
                   stride_split, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.program_id(1)
    split = tl.program_id(2)
    ranks = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_K)
    mine = tl.load(idx_ptr + rows, mask=rows < tokens, other=-1).to(tl.int32) == slot
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        start = split * span  # this program's run of input columns (a multiple of BLOCK_K)
        end = tl.minimum(start + span, width)
        for k in range(start, end, BLOCK_K):
            kk = k + cols
            xv = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mine[:, None] & (kk[None, :] < end),
                         other=0.0)
            av = tl.load(a_ptr + slot * stride_al + ranks[None, :] * stride_ar + kk[:, None] * stride_ak,
                         mask=(ranks[None, :] < rank) & (kk[:, None] < end), other=0.0)
            acc = _dot(xv, av.to(xv.dtype), acc, IEEE, DOT_F32)
        tl.store(s_ptr + split * stride_split + rows[:, None] * rank + ranks[None, :], acc,
                 mask=mine[:, None] & (ranks[None, :] < rank))


@triton.jit
def _expand_kernel(s_ptr, b_ptr, idx_ptr, out_ptr, tokens, num_slots, rank, out_features, splits, stride_split,
                   stride_bl, stride_bn, stride_br, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    slots = tl.load(idx_ptr + rows, mask=rows < tokens, other=-1).to(tl.int32)
    # the shrink's partial products, summed in split order (deterministic: no atomics)
    s_mask = (slots[:, None] >= 0) & (slots[:, None] < num_slots) & (ranks[None, :] < rank)
    sv = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(0, splits):
        sv += tl.load(s_ptr + split * stride_split + rows[:, None] * rank + ranks[None, :], mask=s_mask, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(0, num_slots):
        mine = slots == slot
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            bv = tl.load(b_ptr + slot * stride_bl + cols[None, :] * stride_bn + ranks[:, None] * stride_br,
                         mask=(cols[None, :] < out_features) & (ranks[:, None] < rank), other=0.0)
            part = tl.where(mine[:, None], sv, 0.0)
            if IEEE:
                acc = _dot(part, bv.to(tl.float32), acc, IEEE, DOT_F32)
            else:
                acc = _dot(part.to(bv.dtype), bv, acc, IEEE, DOT_F32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < tokens) & (cols[None, :] < out_features))


def _block_m(tokens: int) -> int:
    """Token tile: 16 for small decode batches (fewer wasted rows), 64 from 256 tokens on (prefill)."""
    return 16 if tokens <= 64 else 32 if tokens < 256 else 64


def _splits(tiles: int, slots: int, width: int, block_k: int, device: torch.device) -> int:
    """Runs of input columns the shrink splits into, so that a decode step's few (tile, slot) programs still fill
    the GPU: a 16-token step over 8 adapters is 8 programs, each reading 4,096 columns alone (about 90 us of a
    4.9 us GEMM on the H200). Enough runs for ~2 programs per SM, each at least 2 tiles of columns wide; one run on
    the CPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    programs = 2 * num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(triton.cdiv(programs, tiles * slots), width // (2 * block_k)))


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor,
               splits: int | None = None) -> torch.Tensor:
    """``[T, out]`` in ``x``'s dtype (see the module docstring); ``x`` has unit stride in its last dim. `splits`:
    the shrink's runs of input columns (default: `_splits`)."""
    tokens, width = x.shape
    slots, rank, _ = a.shape
    out_features = b.shape[1]
    ieee, dot_f32 = x.dtype == torch.float32, not x.is_cuda
    block_m, block_r = _block_m(tokens), max(16, triton.next_power_of_2(rank))
    block_k = 64 if x.element_size() == 4 else 128
    tiles = triton.cdiv(tokens, block_m)
    if splits is None:
        splits = _splits(tiles, slots, width, block_k, x.device)
    span = triton.cdiv(triton.cdiv(width, splits), block_k) * block_k
    splits = triton.cdiv(width, span)  # no empty run
    shrunk = torch.empty((splits, tokens, rank), dtype=torch.float32, device=x.device)
    out = torch.empty((tokens, out_features), dtype=x.dtype, device=x.device)
    _shrink_kernel[(tiles, slots, splits)](
        x, a, index, shrunk, tokens, rank, width, span, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        shrunk.stride(0), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, IEEE=ieee, DOT_F32=dot_f32)
    block_n = 64
    _expand_kernel[(tiles, triton.cdiv(out_features, block_n))](
        shrunk, b, index, out, tokens, slots, rank, out_features, splits, shrunk.stride(0), b.stride(0), b.stride(1),
        b.stride(2), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, IEEE=ieee, DOT_F32=dot_f32)
    return out
