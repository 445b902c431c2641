"""Triton kernels for the KV pool: fused K/V write by slot mapping (quantised for an FP8 cache: `triton_fp8`),
batched block copy (bytes, whatever the dtype).

Imported lazily by :mod:`hf_paged.kernels` (needs triton). Inputs are validated by
the dispatcher; these wrappers only compute launch parameters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_dims import _dim_mask, padded_dim
from .triton_fp8 import _to_cache


@triton.jit
def _write_kv_kernel(
    K,
    V,
    KC,
    VC,
    SLOT,
    KS,
    VS,
    num_heads,
    stride_s,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kch,
    stride_kct,
    stride_vcb,
    stride_vch,
    stride_vct,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    HAS_V: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    slot = tl.load(SLOT + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)  # a head dim that is no power of two is padded, its extra lanes masked
    # (slot broadcast before the compare: the interpreter rejects masks built from scalar & tensor)
    m = _dim_mask((offs_h[:, None] < num_heads) & ((offs_d[None, :] * 0 + slot) >= 0), offs_d[None, :], HEAD_DIM,
                  D_PAD)
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=m)
    kc = KC + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    if QUANT:  # an FP8 cache: one scale per KV head (stride 1) or one for all (stride 0)
        ks = tl.load(KS + offs_h * stride_s, mask=offs_h < num_heads, other=1.0)[:, None]
    else:
        ks = 1.0
    tl.store(kc, _to_cache(k, ks, QUANT, SOFT_FP8, KC.dtype.element_ty), mask=m)
    if HAS_V:  # (else one tensor alone: values of another width, or a layer whose values are its keys)
        v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=m)
        vc = VC + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
        if QUANT:
            vs = tl.load(VS + offs_h * stride_s, mask=offs_h < num_heads, other=1.0)[:, None]
        else:
            vs = 1.0
        tl.store(vc, _to_cache(v, vs, QUANT, SOFT_FP8, VC.dtype.element_ty), mask=m)


def write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """K and V of one width in one launch; `value` None: `key` alone into `key_cache` (the dispatcher launches values
    of another width the same way, as their own "keys")."""
    T, H, D = key.shape
    if T == 0:
        return
    bs = key_cache.shape[2]
    has_v = value is not None
    value, value_cache = (value, value_cache) if has_v else (key, key_cache)
    # at most ~4K elements per program (K and V each)
    d_pad = padded_dim(D)
    block_h = min(triton.next_power_of_2(H), max(1, 4096 // d_pad))
    grid = (T, triton.cdiv(H, block_h))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale if k_scale is not None else slot_mapping,
        v_scale if v_scale is not None else slot_mapping,
        H,
        scale_stride(k_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        BLOCK_SIZE=bs,
        HEAD_DIM=D,
        D_PAD=d_pad,
        BLOCK_H=block_h,
        QUANT=k_scale is not None,
        SOFT_FP8=k_scale is not None and not key.is_cuda,
        HAS_V=has_v,
        num_warps=4 if block_h * d_pad >= 1024 else 1,
    )


def scale_stride(scale: torch.Tensor | None) -> int:
    """The element stride between the KV heads' scales: 0 for one scale shared by every head (or none)."""
    return 1 if scale is not None and scale.shape[0] > 1 else 0


@triton.jit
def _copy_blocks_kernel(
    POOL,
    SRC,
    DST,
    stride_lead,
    stride_blk,
    numel_blk,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    lead = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    src = tl.load(SRC + i).to(tl.int64)
    dst = tl.load(DST + i).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel_blk
    base = POOL + lead * stride_lead
    x = tl.load(base + src * stride_blk + offs, mask=m)
    tl.store(base + dst * stride_blk + offs, x, mask=m)


def copy_blocks_supported(pool: torch.Tensor) -> bool:
    """The kernel needs each block's ``[Hkv, bs, D]`` contiguous and mergeable leading dims."""
    bd = pool.dim() - 4
    _, h, bs, d = pool.shape[bd:]
    if pool.stride()[bd + 1 :] != (bs * d, d, 1):
        return False
    try:
        pool.view(-1, *pool.shape[bd:])
    except RuntimeError:
        return False
    return True


def copy_blocks(pool, src, dst) -> None:
    n = src.shape[0]
    if n == 0:
        return
    bd = pool.dim() - 4
    flat = pool.view(-1, *pool.shape[bd:])
    lead, _, h, bs, d = flat.shape
    numel_blk = h * bs * d
    BLOCK = min(4096, triton.next_power_of_2(numel_blk))
    grid = (n, lead, triton.cdiv(numel_blk, BLOCK))
    _copy_blocks_kernel[grid](
        flat,
        src,
        dst,
        flat.stride(0),
        flat.stride(1),
        numel_blk,
        BLOCK=BLOCK,
        num_warps=4,
    )
