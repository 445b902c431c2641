"""Sampled (and greedy) next-token picks in Triton: no sort, a few tiled passes over each logits row.

One program per row. Passes (see :mod:`hf_paged.kernels.reference_sampling`, which does the same arithmetic):
max; for top-k an NC-way bisection on the order-preserving int key of the scaled logits (count of keys >= each of NC
candidates per pass: ~8 passes for 32 bits at NC=16, fewer when the values span a narrow range); for top-p one mass
pass and the same bisection on masses; then one Gumbel-max draw. Greedy rows (``inv_t == 0``) take one argmax pass.
Randomness is a counter-based hash of (seed, offset, token index), so a row's draw depends on nothing else.

FP contraction is switched off at launch (``enable_fp_fusion=False``) so ``x * inv_t + g`` rounds as in torch.
Imported lazily by :mod:`hf_paged.kernels.sampling` (needs triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference_sampling import NUM_CANDIDATES

BLOCK = 1024


@triton.jit
def _h(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _key(x):
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _search(base, vocab, inv_t, m, lo, hi, target, USE_MASS: tl.constexpr, BLOCK: tl.constexpr, NC: tl.constexpr):
    """Largest key t in [lo, hi] with stat(t) >= target (count or exp-mass of keys >= t); NC candidates a pass."""
    j = tl.arange(0, NC).to(tl.int64) + 1
    cols = tl.arange(0, BLOCK)
    while lo < hi:
        span = hi - lo
        cands = lo + (span * j + NC - 1) // NC
        stat = tl.zeros([NC], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            valid = idx < vocab
            x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            ge = (_key(x)[:, None] >= cands[None, :]) & valid[:, None]
            if USE_MASS:
                w = tl.exp(x - m)
                stat += tl.sum(tl.where(ge, w[:, None], 0.0), axis=0)
            else:
                stat += tl.sum(ge.to(tl.int32), axis=0).to(tl.float32)
        ok = stat >= target
        new_lo = tl.max(tl.where(ok, cands, lo), axis=0)
        new_hi = tl.min(tl.where(ok, hi, cands - 1), axis=0)
        lo = new_lo
        hi = new_hi
    return lo


@triton.jit
def _sample_kernel(logits_ptr, stride, vocab, inv_t_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr, seed_ptr, offset_ptr,
                   out_ptr, BLOCK: tl.constexpr, NC: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    inv_t = tl.load(inv_t_ptr + row)
    cols = tl.arange(0, BLOCK)
    if inv_t <= 0:
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
            better = x > best
            best = tl.where(better, x, best)
            best_i = tl.where(better, idx, best_i)
        top = tl.max(best, axis=0)
        choice = tl.min(tl.where(best == top, best_i, vocab), axis=0)
        tl.store(out_ptr + row, choice.to(tl.int64))
    else:
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        log_min_p = tl.load(log_min_p_ptr + row)
        seed = tl.load(seed_ptr + row)
        off = tl.load(offset_ptr + row)
        # pass 1: max and min of the scaled row
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        mn = tl.full([BLOCK], float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            valid = idx < vocab
            x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            mx = tl.maximum(mx, x)
            mn = tl.minimum(mn, tl.where(valid, x, float("inf")))
        m = tl.max(mx, axis=0)
        lo = _key(tl.min(mn, axis=0))
        hi = _key(m)
        if (top_k > 0) & (top_k < vocab):
            lo = _search(base, vocab, inv_t, m, lo, hi, top_k.to(tl.float32), False, BLOCK, NC)
        if top_p < 1.0:
            z = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, vocab, BLOCK):
                idx = start + cols
                valid = idx < vocab
                x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
                z += tl.where(valid & (_key(x) >= lo), tl.exp(x - m), 0.0)
            lo = _search(base, vocab, inv_t, m, lo, hi, top_p * tl.sum(z, axis=0), True, BLOCK, NC)
        # draw: Gumbel-max among kept tokens
        k = _h(((off >> 32) & 0xFFFFFFFF) ^ 0x9E3779B9)
        k = _h((off & 0xFFFFFFFF) ^ k)
        k = _h(((seed >> 32) & 0xFFFFFFFF) ^ k)
        k1 = _h((seed & 0xFFFFFFFF) ^ k)
        k2 = _h(k1 ^ 0x85EBCA6B)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], dtype=tl.int32) + vocab
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            valid = idx < vocab
            x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            bits = _h(_h(idx.to(tl.int64) ^ k1) ^ k2)
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            g = -tl.log(-tl.log(u))
            keep = valid & (_key(x) >= lo) & ((x - m) >= log_min_p)
            score = tl.where(keep, x + g, float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_i = tl.where(better, idx, best_i)
        top = tl.max(best, axis=0)
        choice = tl.min(tl.where(best == top, best_i, vocab), axis=0)
        choice = tl.where(choice >= vocab, 0, choice)
        tl.store(out_ptr + row, choice.to(tl.int64))


def sample_tokens(logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  log_min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    _sample_kernel[(rows,)](logits, logits.stride(0), vocab, inv_t, top_k, top_p, log_min_p, seed, offset, out,
                            BLOCK=BLOCK, NC=NUM_CANDIDATES, num_warps=8, enable_fp_fusion=False)
    return out
