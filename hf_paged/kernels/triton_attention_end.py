"""The ends of a paged attention program: its softmax state normalised (sinks folded in) and written, or a decode
program's split partials combined.

A module of its own so that the kernels' files keep to their jobs (the key loops, the split cut) and the prefill and
decode kernels share one normalisation. These are `triton.jit` helpers and the decode's separate combine kernel;
`triton_decode` and `triton_prefill` call and launch them. Imported lazily with them (needs triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_dims import _dim_mask

__all__ = ["_combine_splits", "_normalise", "_paged_decode_reduce_kernel", "_write_output"]


@triton.jit
def _normalise(acc, m_i, l_i, SINK, head, mask, HAS_SINKS: tl.constexpr):
    """The attention output (float32) of a whole-range softmax state: `acc` ``[rows, D]`` over its sum `l_i`, with
    each row's head sink (`SINK[head]`, masked by `mask`) joining the denominator when `HAS_SINKS`."""
    if HAS_SINKS:  # one extra logit per head that only joins the denominator (gpt-oss s_aux)
        sink = tl.load(SINK + head, mask=mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_i, sink)
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        corr = tl.math.exp2(m_i - m_all)
        l_i = l_i * corr + tl.math.exp2(sink - m_all)
        acc = acc * corr[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_safe[:, None]


@triton.jit
def _write_output(acc, m_i, l_i, SINK, OUT, b64, head, gmask, offs_dv, stride_ob, stride_oh,
                  HAS_SINKS: tl.constexpr, HEAD_DIM_V: tl.constexpr, DV_PAD: tl.constexpr):
    """Normalise one decode program's whole-range softmax state and store it as the output rows of its heads."""
    o = _normalise(acc, m_i, l_i, SINK, head, gmask, HAS_SINKS)
    po = OUT + b64 * stride_ob + head[:, None] * stride_oh + offs_dv[None, :]
    tl.store(po, o.to(OUT.dtype.element_ty), mask=_dim_mask(gmask[:, None], offs_dv[None, :], HEAD_DIM_V, DV_PAD))


@triton.jit
def _combine_splits(PACC, PM, PL, SINK, OUT, b64, heads, hmask, num_splits, stride_pab, stride_pah, stride_pas,
                    stride_pmb, stride_pmh, stride_ob, stride_oh, HEAD_DIM: tl.constexpr, HAS_SINKS: tl.constexpr,
                    D_PAD: tl.constexpr):
    """Combine the split partials of sequence `b64`'s `heads` (masked by `hmask`) in split order, into `OUT`.

    A plain loop, not a vector reduction: splits a sequence did not use hold (m = -inf, l = 0, acc = 0) and add exact
    zeros, so the sum does not depend on how many such splits the grid had (a tree reduction over a padded vector
    would round differently for another count). Element-wise in the heads, so the reduce kernel and the decode
    kernel's fused combine give the same bits. Loads bypass L1 (`.cg`): in the fused combine other programs wrote
    the partials during this launch."""
    offs_d = tl.arange(0, D_PAD)
    dmask = _dim_mask(hmask[:, None], offs_d[None, :], HEAD_DIM, D_PAD)
    pm = b64 * stride_pmb + heads * stride_pmh
    m_max = tl.load(PM + pm, mask=hmask, other=float("-inf"), cache_modifier=".cg")
    for s in range(1, num_splits):
        m_max = tl.maximum(m_max, tl.load(PM + pm + s, mask=hmask, other=float("-inf"), cache_modifier=".cg"))
    if HAS_SINKS:
        sink = tl.load(SINK + heads, mask=hmask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.zeros_like(m_use)
    o = tl.zeros([m_use.shape[0], D_PAD], dtype=tl.float32)
    pa = PACC + b64 * stride_pab + heads[:, None] * stride_pah + offs_d[None, :]
    for s in range(0, num_splits):
        w = tl.math.exp2(tl.load(PM + pm + s, mask=hmask, other=float("-inf"), cache_modifier=".cg") - m_use)
        l_tot += tl.load(PL + pm + s, mask=hmask, other=0.0, cache_modifier=".cg") * w
        o += tl.load(pa + s * stride_pas, mask=dmask, other=0.0, cache_modifier=".cg") * w[:, None]
    if HAS_SINKS:
        l_tot += tl.math.exp2(sink - m_use)
    l_safe = tl.where(l_tot == 0.0, 1.0, l_tot)
    o = o / l_safe[:, None]
    tl.store(OUT + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], o.to(OUT.dtype.element_ty),
             mask=dmask)


@triton.jit
def _paged_decode_reduce_kernel(
    PACC,
    PM,
    PL,
    SINK,
    OUT,
    num_splits,
    stride_pab,
    stride_pah,
    stride_pas,
    stride_pmb,
    stride_pmh,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Combine the partials of one (sequence, KV head): its `G` query heads (when the decode kernel did not)."""
    b = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    heads = tl.program_id(1) * G + offs_g
    _combine_splits(PACC, PM, PL, SINK, OUT, b, heads, offs_g < G, num_splits, stride_pab, stride_pah, stride_pas,
                    stride_pmb, stride_pmh, stride_ob, stride_oh, HEAD_DIM, HAS_SINKS, D_PAD)
