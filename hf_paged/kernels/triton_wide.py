"""Heads wider than 256 values in the Triton attention kernels: multi-head latent attention's 576-value latent
(DeepSeek-V2/V3, GLM-4.7-Flash, MiniCPM3) and Gemma 4's 512-value global heads.

Why kernels of their own (`triton_decode_wide`, `triton_prefill_wide`): the narrow kernels hold a head in one register
tile padded to a power of two, so 576 would become a 1,024-lane tile (44 % of it padding) that, with the default
tiles, needs more shared memory than an H100/H200 has. Their launches at today's widths (<= 256) are tuned; the wide
path leaves them as they were and takes only heads over 256 (`checks.triton_wide_heads`).

How a wide head is computed:

* Keys: a key head of ``d`` values is two tiles, its first ``DM`` values (the largest power of two <= d, at most 512)
  and the rest (``DT``: padded to a power of two, masked), so ``q . k = q[:DM] . k[:DM] + q[DM:] . k[DM:]``:
  576 = 512 + 64 needs no padding, 512 is one tile, 1,024 is 512 + 512 (`key_split`).
* Values: one ``[rows, DV_PAD]`` float32 accumulator. When the value cache is the key cache, or a view of its first
  columns (the same storage and strides: MLA's adapter passes the latent for both and uses its first 512 columns),
  and ``DV_PAD == DM``, the value tile is the key tile's main part, transposed (`SHARED_V`): the latent is read once
  per key tile, as vLLM's FlashMLA does (`values_are_keys`).
* Query heads: a program takes at most `BLOCK_H` (decode) or ``BLOCK_M`` rows (prefill) of query heads; a KV head
  read by more (MLA: 16 per KV head in DeepSeek-V2-Lite, 128 in V3) is split over head-block programs, each reading
  its keys again (L2 serves the repeats), so the accumulator stays ``16 x 512`` floats per program.

Imported lazily with the kernels (needs triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_dims import _dim_mask, padded_dim
from .triton_fp8 import _fp8_tile

__all__ = ["MAX_MAIN", "_dot", "_load_query", "_wide_pv", "_wide_qk", "key_split", "values_are_keys"]

MAX_MAIN = 512  # the widest key tile: its [512, BLOCK_N] operand, twice for pipelining, plus the value tile fit


def key_split(d: int) -> tuple[int, int]:
    """(DM, DT): the main key tile's width (a power of two, <= 512) and the padded width of the rest (0: none)."""
    if d <= 256:
        return padded_dim(d), 0
    main = min(MAX_MAIN, 1 << (d.bit_length() - 1))
    rest = d - main
    return main, padded_dim(rest) if rest else 0


def values_are_keys(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether `value_cache` is `key_cache` or a view of its first columns (same storage, block / head / token strides
    and dtype), and the value tile would be the main key tile (`key_split`), so the kernels may reuse it."""
    dv = value_cache.shape[-1]
    return (value_cache.data_ptr() == key_cache.data_ptr() and value_cache.dtype == key_cache.dtype
            and value_cache.stride()[:3] == key_cache.stride()[:3] and dv <= key_cache.shape[-1]
            and padded_dim(dv) == key_split(key_cache.shape[-1])[0])


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr, IEEE: tl.constexpr):
    """`tl.dot(a, b)` in float32: emulated with float32 operands under the interpreter (no 16-bit dot there), IEEE
    for float32 inputs, else the tensor cores' default."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _wide_qk(q_m, q_t, k_base, blk, off, valid, stride_kb, stride_kt, offs_km, offs_kt, HEAD_DIM: tl.constexpr,
             DM: tl.constexpr, DT: tl.constexpr, HAS_TAIL: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
             READ: tl.constexpr = "cast"):
    """Raw scores ``q . k`` ``[rows, BLOCK_N]`` of one key tile (keys at block `blk`, offset `off`; `valid` masks
    them), in two products: the main key tile ``[DM, BLOCK_N]`` and, `HAS_TAIL`, the rest ``[DT, BLOCK_N]``. Also
    returns the main tile, as the dots' operand, for a caller whose values are the keys. An FP8 cache's tiles are
    read as `READ` says (`triton_fp8`; "cast": in the query's dtype, exact)."""
    row = k_base + blk[None, :] * stride_kb + off[None, :] * stride_kt
    k_m = _fp8_tile(tl.load(row + offs_km[:, None], mask=_dim_mask(valid[None, :], offs_km[:, None], HEAD_DIM, DM),
                            other=0.0), READ, q_m.dtype)
    s = _dot(q_m, k_m, DOT_F32, IEEE)
    if HAS_TAIL:
        k_t = _fp8_tile(tl.load(row + offs_kt[:, None], other=0.0,
                                mask=_dim_mask(valid[None, :], offs_kt[:, None], HEAD_DIM, DM + DT)), READ, q_m.dtype)
        s += _dot(q_t, k_t, DOT_F32, IEEE)
    return s, k_m


@triton.jit
def _base2_logits(s, qk_scale, sm_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw logits `s` scaled into base 2 (`qk_scale` = scale * log2(e)), soft-capped first when `HAS_SOFTCAP`
    (cap * tanh(x / cap) in natural units, tanh written with exp2): one place for both wide kernels."""
    if HAS_SOFTCAP:
        x = s * sm_scale / softcap
        return softcap * (1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)) * 1.4426950408889634
    return s * qk_scale


@triton.jit
def _wide_pv(p, k_m, v_base, blk, off, valid, stride_vb, stride_vt, offs_dv, HEAD_DIM_V: tl.constexpr,
             DV_PAD: tl.constexpr, SHARED_V: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr,
             READ: tl.constexpr = "cast"):
    """``p @ v`` ``[rows, DV_PAD]`` of one key tile: `SHARED_V`, the values are the main key tile `k_m` transposed
    (no second load); else the value tile is loaded (keys outside `valid` as zeros) and read as `READ` says."""
    if SHARED_V:
        v = tl.trans(k_m)
    else:
        v = _fp8_tile(tl.load(v_base + blk[:, None] * stride_vb + off[:, None] * stride_vt + offs_dv[None, :],
                              mask=_dim_mask(valid[:, None], offs_dv[None, :], HEAD_DIM_V, DV_PAD), other=0.0), READ,
                      k_m.dtype)
    return _dot(p.to(v.dtype), v, DOT_F32, IEEE)


@triton.jit
def _load_query(Q, row_off, row_ok, offs_km, offs_kt, HEAD_DIM: tl.constexpr, DM: tl.constexpr, DT: tl.constexpr,
                HAS_TAIL: tl.constexpr):
    """The query rows at element offsets `row_off` ``[rows]``: ``[rows, DM]`` and (`HAS_TAIL`) ``[rows, DT]``, the
    parts the two key tiles meet (masked rows and lanes zero); without a tail the second is the first, unused."""
    base = Q + row_off[:, None]
    q_m = tl.load(base + offs_km[None, :], mask=_dim_mask(row_ok[:, None], offs_km[None, :], HEAD_DIM, DM), other=0.0)
    q_t = q_m
    if HAS_TAIL:
        q_t = tl.load(base + offs_kt[None, :], mask=_dim_mask(row_ok[:, None], offs_kt[None, :], HEAD_DIM, DM + DT),
                      other=0.0)
    return q_m, q_t
