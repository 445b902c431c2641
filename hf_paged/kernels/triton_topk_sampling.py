"""The sampler's top-k fast path in Triton: one selection of each row's largest logits, a small kernel that samples
from them, and the full kernel (:mod:`hf_paged.kernels.triton_sampling`) for the rows they cannot decide.

Why: the full kernel runs one program per row and reads a row of a large vocabulary several times to find its top-k
threshold (H200, Gemma-3-1B's 262,144 tokens, 240 flat bf16 rows at top-k 64 / top-p 0.95: 1.42 ms). With top-k on,
every token the draw can take is among the row's k largest (ties at the boundary aside), so:

1. ``torch.topk(logits, count)`` (sorted; ``count`` = `candidate_count` of the call's largest k: the k largest and a
   margin, so that a tie at the k-th value usually ends inside the list). It takes most of the path's time on long
   rows (H200, 240 bf16 rows of 262,144, count 128: 547 of 557 us); a topk in two rounds (the rows cut in pieces of
   8,192, the largest of each, then of those) was slower at every row count (684 us at 240 rows, 78 against 60 us at
   one; `benchmarks/results/h200_2026-11-29d/`). `TOPK_SELECT` = ``"radix"`` takes the same list from Triton
   instead (:mod:`hf_paged.kernels.triton_radix_select`: a bound on the ``count``-th value from group maxima, one
   pass collecting the few values above it, a sort of those; rows with too many, from ties or masks, take an exact
   8-bit radix select), which reads most rows twice;
2. `_candidate_kernel`, one program per row on its ``count`` candidates: the decisions of
   `reference_sampling.candidate_tokens` (top-k set with its boundary ties, top-p on the running mass, min-p, the
   Gumbel-max draw with the full kernel's noise and float operations), or -1 where the list cannot decide the row
   (a tie at the k-th value reaching the list's end, a zero or NaN in the kept set, a non-finite maximum, top-k off
   or not below ``count``; a greedy row whose maximum is tied up to the list's end);
3. the full kernel with ``SKIP_DECIDED``: its programs return at once for rows holding a token, the rest sample as
   without the fast path.

No host sync: which rows fall back is read on the device, so the three launches are the same whatever the logits
(safe under CUDA-graph capture; a captured call stays exact for any parameters, a row the list cannot decide falls
back). The tokens are the full kernel's: the same scaled values, keys, noise and tie rules; only the order of the
mass sums differs, as between the full kernel and the reference.

Imported lazily by :mod:`hf_paged.kernels.sampling` (needs triton).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import triton_radix_select, triton_sampling
from .triton_sampling import _h, _pick

# how the fast path selects each row's largest logits: "torch" (torch.topk) or "radix" (`triton_radix_select`), both
# the same list up to what the candidate kernel ignores (which keys tied at the list's end, the order of equal
# values), so the same tokens. Read at every call (a benchmark sets it to compare); HF_PAGED_TOPK_SELECT sets it at
# import. "torch" until the radix select is measured end to end on a GPU (warmed: `sampling.warm_up_selection`).
TOPK_SELECT = os.environ.get("HF_PAGED_TOPK_SELECT", "torch")
SELECTS = ("torch", "radix")

# the candidate tile: one compiled variant for every candidate count up to `BLOCK` (`candidate_count` of k <= 256)
BLOCK = 512
NUM_WARPS = 4

@triton.jit(do_not_specialize=["count", "vocab"])  # one variant a logits dtype, whatever k and the vocabulary
def _candidate_kernel(values_ptr, indices_ptr, count, vocab, inv_t_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr,
                      seed_ptr, offset_ptr, out_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    pos = tl.arange(0, BLOCK)
    valid = pos < count
    at = row.to(tl.int64) * count + pos
    v = tl.load(values_ptr + at, mask=valid, other=float("-inf")).to(tl.float32)
    idx = tl.load(indices_ptr + at, mask=valid, other=0).to(tl.int64)
    none = tl.full([BLOCK], 0, tl.int64) + vocab
    full = count >= vocab
    inv_t = tl.load(inv_t_ptr + row)
    if inv_t <= 0:  # greedy: the least index of the maximum, when no token past the list equals it
        top = _pick(v, pos == 0)
        ok = (top == top) & (full | (_pick(v, pos == count - 1) < top))
        choice = tl.min(tl.where(valid & (v == top), idx, none), axis=0)
    else:
        x = v * inv_t  # the padding stays -inf
        k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        log_min_p = tl.load(log_min_p_ptr + row)
        m = _pick(x, pos == 0)
        kth = _pick(x, pos == k - 1)
        in_k = valid & (x >= kth)  # the top-k set, ties at the boundary included
        bad = tl.sum((in_k & ((x == 0.0) | (x != x))).to(tl.int32), axis=0)
        ok = (k >= 1) & (k < count) & (m < float("inf")) & (kth == kth) & (bad == 0)
        ok = ok & (full | (kth > _pick(x, pos == count - 1)))
        e = tl.where(in_k, tl.exp(x - m), 0.0)
        running = tl.cumsum(e, axis=0)
        z = _pick(running, pos == BLOCK - 1)
        j = tl.min(tl.where(in_k & (running >= top_p * z), pos, BLOCK), axis=0)
        thr = tl.where((top_p < 1.0) & (j < BLOCK), _pick(x, pos == j), kth)
        keep = in_k & (x >= thr) & ((x - m) >= log_min_p)
        seed = tl.load(seed_ptr + row)
        off = tl.load(offset_ptr + row)
        h = _h(((off >> 32) & 0xFFFFFFFF) ^ 0x9E3779B9)
        h = _h((off & 0xFFFFFFFF) ^ h)
        h = _h(((seed >> 32) & 0xFFFFFFFF) ^ h)
        k1 = _h((seed & 0xFFFFFFFF) ^ h)
        k2 = _h(k1 ^ 0x85EBCA6B)
        bits = _h(_h(idx ^ k1) ^ k2)
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as `triton_sampling._draw`
        score = tl.where(keep, x + -tl.log(-tl.log(u)), float("-inf"))
        best = tl.max(score, axis=0)
        choice = tl.min(tl.where(keep & (score == best), idx, none), axis=0)
    tl.store(out_ptr + row, tl.where(ok, choice, -1))


def candidate_tokens(values: torch.Tensor, indices: torch.Tensor, vocab: int, inv_t: torch.Tensor,
                     top_k: torch.Tensor, top_p: torch.Tensor, log_min_p: torch.Tensor, seed: torch.Tensor,
                     offset: torch.Tensor, *, candidate_block: int = BLOCK) -> torch.Tensor:
    """`reference_sampling.candidate_tokens` in one launch: ``[R]`` int64, a token or -1. ``values, indices
    [R, L]``: ``torch.topk`` of the rows (sorted), ``L <= candidate_block`` (a power of two)."""
    rows, count = values.shape
    if count > candidate_block:
        raise ValueError(f"{count} candidates do not fit the candidate tile of {candidate_block}")
    out = torch.empty(rows, dtype=torch.long, device=values.device)
    if rows:
        _candidate_kernel[(rows,)](values.contiguous(), indices.contiguous(), count, vocab, inv_t, top_k, top_p,
                                   log_min_p, seed, offset, out, BLOCK=candidate_block, num_warps=NUM_WARPS,
                                   enable_fp_fusion=False)
    return out


def select_candidates(logits: torch.Tensor, count: int, select: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``min(count, V)`` largest logits and their indices, sorted from the largest, by ``select``
    (`TOPK_SELECT` when None): ``torch.topk``'s, or the radix select's (int32 indices)."""
    select = TOPK_SELECT if select is None else select
    if select == "radix":
        return triton_radix_select.select_top(logits, count)
    if select == "torch":
        return torch.topk(logits, min(count, logits.shape[1]), dim=1)
    raise ValueError(f"unknown top-k selection {select!r} (HF_PAGED_TOPK_SELECT): one of {SELECTS}")


def sample_top_k(logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 log_min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, count: int, *,
                 candidate_block: int = BLOCK, select: str | None = None, **full_kernel) -> torch.Tensor:
    """`triton_sampling.sample_tokens`' tokens through the fast path (module docstring): ``count`` candidates a row
    (``2 <= count <= candidate_block``) chosen by ``select`` (`select_candidates`); ``full_kernel``: that function's
    tuning knobs, for the rows that fall back."""
    values, indices = select_candidates(logits, count, select)
    decided = candidate_tokens(values, indices, logits.shape[1], inv_t, top_k, top_p, log_min_p, seed, offset,
                               candidate_block=candidate_block)
    return triton_sampling.sample_tokens(logits, inv_t, top_k, top_p, log_min_p, seed, offset, decided=decided,
                                         **full_kernel)
