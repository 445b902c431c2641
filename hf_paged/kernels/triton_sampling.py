"""Sampled (and greedy) next-token picks in Triton: no sort of the row, a few tiled passes over each logits row.

One program per row. The decisions are those of :mod:`hf_paged.kernels.reference_sampling` (top-k threshold = the
largest key whose count of keys ``>=`` it reaches k; top-p threshold = the largest key whose mass ``sum exp(x - m)``
of keys ``>=`` it reaches ``p * Z_k``; min-p; one Gumbel-max draw with the same counter-based noise). Each threshold
is unique, so any search that finds it gives the same tokens; this one is built to read the row few times:

* pass 1 reads the row once for its max, its finite min and (online, per lane) the softmax mass Z;
* a search pass evaluates NC candidate thresholds at once, count and mass together, accumulating per-lane partials
  and reducing them once per pass (a cross-warp reduction per tile made the first kernel latency-bound). Candidates
  are spread evenly in *value* while the interval spans many binades (an even spread of int keys is a log scale,
  which wastes passes on tiny magnitudes), then evenly in key;
* once the interval ``[lo, hi]`` holds at most ``CAP`` tokens, one pass copies them (value and index, in vocabulary
  order) to a per-row scratch list; the remaining passes read only that list, plus the known count and mass of the
  tokens above ``hi``. When nothing lies above ``hi`` the list holds every token the draw can keep, and the draw
  reads the list too; otherwise the draw is one more pass over the row. When every token from the interval's low end
  up fits the list, the list takes them all, so that a top-k row's top-p phase and its draw read the list;
* once the list covers the interval and the interval holds at most ``SORT_N`` tokens, their keys are sorted and the
  threshold read off them (the key of a rank; the key where the running mass reaches the target), instead of the
  eight or so more candidate passes a bisection takes to pin a key down.

A real model's peaked rows usually end on a list of a few tokens after two row passes; a near-flat row (random
weights, top-p keeping most of the vocabulary) needs two or three.

Top-p rows without top-k (p >= ``DRAW_FIRST_MIN_P``) draw first: the Gumbel-max over every token (min-p applied) is
the draw over the kept ones whenever it is kept itself, which it is iff the mass of the keys above its own is
``< p * Z``: one row pass to draw, one to check. A draw that is not kept bounds the threshold from below and the next
draw is over the keys above it; after ``DRAW_FIRST_ROUNDS`` such rounds the row searches as above. With p = 0.95 most
rows end after three row passes, none of them a search pass.

With ``decided`` (the top-k fast path, :mod:`hf_paged.kernels.triton_topk_sampling`) the kernel is compiled with
``SKIP_DECIDED``: a row whose token the fast path already wrote to ``out`` (>= 0) returns at once, the others (-1)
run as above.

FP contraction is switched off at launch (``enable_fp_fusion=False``) so ``x * inv_t + g`` rounds as in torch.
Imported lazily by :mod:`hf_paged.kernels.sampling` (needs triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import triton_interpreting

BLOCK = 2048  # tile of a row pass (argmax, max/min/Z, compaction, draw)
# The search pass is compute-bound (NC compares and masked sums per element), so fewer candidates per pass, a wider
# tile and more warps won: on the H100 (bf16 rows of 151,936, T 0.6 / top-p 0.95) 8 / 1024 / 16 warps took 551-585 µs
# for one row and 1,155 µs for 256 flat rows, against 667 and 1,383 µs with 16 / 512 / 8
# (benchmarks/results/h100_2026-11-25c/sweep_nc.log). Same tokens with every setting.
SEARCH_BLOCK = 1024  # tile of a search pass: its [SEARCH_BLOCK, NC] partials stay in registers
NC = 8  # candidate thresholds per search pass
# scratch list capacity per row: a wider list is taken one search pass earlier. 16384 (vs 4096) took a flat top-p row
# 10-11 % faster on the H100 at 1 to 256 rows and changed nothing else (benchmarks/results/h100_2026-11-25d/sampler/
# cmp_cap.log, same tokens); the scratch is rows x CAP x 8 bytes a call (33 MB at 256 rows).
CAP = 16384
NUM_WARPS = 16
PREFETCH = True  # search passes issue the next tile's load first
# top-p rows without top-k, p >= DRAW_FIRST_MIN_P, first draw and then check (see `_sample_kernel`): up to
# DRAW_FIRST_ROUNDS rounds of (draw, check) before the search. H100, rows of 151,936 (benchmarks/results/
# h100_2026-11-27d/, call c): T 0.6 / top-p 0.95 1.5-3.8x faster at 1-256 rows (1,060 -> 407 us at 256 flat bf16
# rows), top-p 0.9 + min-p 0.05 2.7-3.9x; at top-p 0.5 a row often needs several rounds and then the search, from
# 0.5x to 1.6x: below DRAW_FIRST_MIN_P rows search at once, as before. Same tokens everywhere.
DRAW_FIRST_ROUNDS = 4
DRAW_FIRST_MIN_P = 0.8
# once a search's interval holds at most SORT_N tokens and the scratch list covers it, the answer is read off the list's
# keys sorted (`_select`) instead of by more search passes over the list (a bisection of NC candidates per pass takes
# about eight passes to pin a key down). The row compaction also takes every token from the interval up when they fit
# the list (`lo_cnt <= CAP`), so a top-k row's top-p phase and its draw read the list too. 0: neither (the search as
# before; a tuning knob, the tokens are the same). H100, rows of 151,936 bf16, against 0 (benchmarks/results/
# h100_2026-11-27e/): top-k 50 + top-p 0.95 1.5-2.1x faster at 1-256 rows (1,292 -> 685 us at 256), top-k 1000 +
# top-p 0.9 1.4-2.0x; 1024 was as fast at 1-128 rows but 860 us at 256, and half as fast on top-k 1000. Where the kept
# set is thousands of tokens (flat rows at top-p 0.5, top-k 5000) the sort does not pay and costs 5-10 %; draw-first
# rows (top-p 0.95) do not search. 2048 makes ptxas spill 24 bytes at 16 warps (128 registers; 1024 does not).
SORT_N = 2048
# under the interpreter (CPU tests) a bitonic sort runs in Python: 2,048 keys take seconds, 64 a fraction of one
INTERPRETED_SORT_N = 64
_VALUE_SPAN = 1 << 24  # key spans above this (about two binades) take value-spaced candidates


@triton.jit
def _h(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _key(x):
    """Order-preserving int32 key of float32 values (the reference's `float_key`)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _unkey(k):
    bits = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _candidates(lo, hi, NC: tl.constexpr, VALUE_SPAN: tl.constexpr):
    """NC non-decreasing int32 keys in (lo, hi] (lo < hi), the last one hi: even in value for wide spans (when the
    low end is finite), else even in key."""
    j = tl.arange(0, NC).to(tl.int64) + 1
    lo64 = lo.to(tl.int64)
    span = hi.to(tl.int64) - lo64
    by_key = (lo64 + (span * j + NC - 1) // NC).to(tl.int32)
    v_lo = _unkey(lo)
    v_hi = _unkey(hi)
    frac = j.to(tl.float32) * (1.0 / NC)
    by_value = _key(v_lo + (v_hi - v_lo) * frac)
    by_value = tl.minimum(tl.maximum(by_value, lo + 1), hi)
    by_value = tl.where(j == NC, hi, by_value)
    use_value = (span > VALUE_SPAN) & (v_lo > float("-inf")) & (v_hi < float("inf"))
    return tl.where(use_value, by_value, by_key)


@triton.jit
def _stats(ptr, n, scale, m, cands, BLOCK: tl.constexpr, NC: tl.constexpr, PREFETCH: tl.constexpr):
    """Count and mass ``sum exp(x - m)`` of the values ``x = ptr[i] * scale`` (i < n) whose key is >= each
    candidate. Per-lane partials, one reduction at the end. With PREFETCH the next tile's load is issued before this
    tile's compares, so its latency overlaps them (one row is one program: nothing else hides it)."""
    cols = tl.arange(0, BLOCK)
    cnt = tl.zeros([BLOCK, NC], dtype=tl.int32)
    mass = tl.zeros([BLOCK, NC], dtype=tl.float32)
    nxt = tl.load(ptr + cols, mask=cols < n, other=float("-inf"))
    for start in range(0, n, BLOCK):
        if PREFETCH:
            cur = nxt
            ahead = start + BLOCK + cols
            nxt = tl.load(ptr + ahead, mask=ahead < n, other=float("-inf"))
        else:
            idx = start + cols
            cur = tl.load(ptr + idx, mask=idx < n, other=float("-inf"))
        x = cur.to(tl.float32) * scale
        ge = _key(x)[:, None] >= cands[None, :]
        cnt += ge.to(tl.int32)
        mass += tl.where(ge, tl.exp(x - m)[:, None], 0.0)
    return tl.sum(cnt, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _mass_above(ptr, n, scale, m, k, BLOCK: tl.constexpr):
    """Mass ``sum exp(x - m)`` of the values ``x = ptr[i] * scale`` (i < n) whose key is > k."""
    cols = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + cols
        x = tl.load(ptr + idx, mask=idx < n, other=float("-inf")).to(tl.float32) * scale
        mass += tl.where(_key(x) > k, tl.exp(x - m), 0.0)
    return tl.sum(mass, axis=0)


@triton.jit
def _pick(values, sel):
    """The entry of `values` where `sel` (one-hot or all False -> 0)."""
    return tl.sum(tl.where(sel, values, tl.zeros_like(values)), axis=0)


@triton.jit
def _compact(base, vocab, inv_t, lo, hi, list_x, list_i, BLOCK: tl.constexpr):
    """Copy the values (scaled) and indices of the keys in [lo, hi] to the scratch list, in vocabulary order."""
    cols = tl.arange(0, BLOCK)
    n = tl.zeros([], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        valid = idx < vocab
        x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        k = _key(x)
        sel = ((k >= lo) & (k <= hi) & valid).to(tl.int32)
        pos = n + tl.cumsum(sel, axis=0) - 1
        tl.store(list_x + pos, x, mask=sel > 0)
        tl.store(list_i + pos, idx, mask=sel > 0)
        n += tl.sum(sel, axis=0)


@triton.jit
def _shrink(list_x, list_i, n, lo, hi, BLOCK: tl.constexpr):
    """Keep, in place and in order, the scratch list's entries whose key is in [lo, hi]; returns how many. Safe in
    place: the entries kept from one tile go below the tile's end, and the next tile is read from there on."""
    cols = tl.arange(0, BLOCK)
    kept = tl.zeros([], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        pos = start + cols
        valid = pos < n
        x = tl.load(list_x + pos, mask=valid, other=float("-inf"))
        i = tl.load(list_i + pos, mask=valid, other=0)
        k = _key(x)
        sel = ((k >= lo) & (k <= hi) & valid).to(tl.int32)
        to = kept + tl.cumsum(sel, axis=0) - 1
        tl.debug_barrier()  # every lane has read this tile before any lane writes into it
        tl.store(list_x + to, x, mask=sel > 0)
        tl.store(list_i + to, i, mask=sel > 0)
        kept += tl.sum(sel, axis=0)
    tl.debug_barrier()
    return kept


@triton.jit
def _select(list_x, n, m, lo, above_cnt, above_mass, target_count, target_mass, use_mass, SORT_N: tl.constexpr):
    """`_search`'s answer read off a scratch list of `n` <= SORT_N tokens that holds every key of its interval, with
    (above_cnt, above_mass) the stats of the keys above the list: the list's keys sorted, largest first, `s`. For a
    count the answer is the key of rank `target_count` (counting the keys above the list): `s[target - above - 1]`,
    ties included. For a mass it is `s[j]`, `j` the first rank whose running mass reaches the target: the mass of
    the keys >= `s[j]` does, that of the next larger key does not. Returns (key, its count, its mass); `lo` when
    rounding left the target just out of reach (the search's invariant says `lo` reaches it)."""
    pos = tl.arange(0, SORT_N)
    valid = pos < n
    x = tl.load(list_x + pos, mask=valid, other=float("-inf"))
    s = tl.sort(tl.where(valid, _key(x), -2147483648), descending=True)  # the padding sorts last
    e = tl.where(valid, tl.exp(_unkey(s) - m), 0.0)
    running = tl.cumsum(e, axis=0) + above_mass
    by_mass = tl.min(tl.where(valid & (running >= target_mass), pos, SORT_N), axis=0)
    j = tl.where(use_mass, by_mass, target_count - above_cnt - 1)
    found = (j >= 0) & (j < n)
    t = tl.where(found, tl.maximum(_pick(s, pos == j), lo), lo)
    ge = valid & (s >= t)
    return t, above_cnt + tl.sum(ge.to(tl.int32), axis=0), above_mass + tl.sum(tl.where(ge, e, 0.0), axis=0)


@triton.jit
def _sorts(covered, inside, SORT_N: tl.constexpr):
    """Whether `_search` reads its answer off the sorted list now: the list covers the interval, which holds at most
    SORT_N tokens. Never with SORT_N = 0 (decided at compile time: the sort is then not compiled at all)."""
    if SORT_N > 0:
        return covered & (inside <= SORT_N)
    else:
        return False


@triton.jit
def _sort_step(list_x, list_i, m, lo, hi, lo_cnt, lo_mass, hi_cnt, hi_mass, list_lo, list_hi, list_n, above_cnt,
               above_mass, target_count, target_mass, use_mass, SEARCH_BLOCK: tl.constexpr, SORT_N: tl.constexpr):
    """`_search`'s last step when `_sorts`: the list first shrunk in place to the interval when longer than SORT_N
    (from lo up to list_hi when that fits, else [lo, hi]), then the answer read off its sorted keys (`_select`).
    Returns the answer's (key, count, mass) and the list's state."""
    if SORT_N > 0:
        if list_n > SORT_N:
            if lo_cnt - above_cnt > SORT_N:
                list_hi = hi
                above_cnt = hi_cnt
                above_mass = hi_mass
            list_n = _shrink(list_x, list_i, list_n, lo, list_hi, SEARCH_BLOCK)
            list_lo = lo
        lo, lo_cnt, lo_mass = _select(list_x, list_n, m, lo, above_cnt, above_mass, target_count, target_mass,
                                      use_mass, SORT_N)
    return lo, lo_cnt, lo_mass, list_lo, list_hi, list_n, above_cnt, above_mass


@triton.jit
def _search(base, vocab, inv_t, m, list_x, list_i, target_mass, target_count, use_mass,
            lo, hi, lo_cnt, lo_mass, hi_cnt, hi_mass, has_list, list_lo, list_hi, list_n, above_cnt, above_mass,
            top_key, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NC: tl.constexpr, CAP: tl.constexpr,
            VALUE_SPAN: tl.constexpr, PREFETCH: tl.constexpr, SORT_N: tl.constexpr):
    """Largest key t in [lo, hi] whose stat (count, or mass with `use_mass`) of keys >= t reaches its target
    (`target_count` or `target_mass`), given that `lo`'s does. Carries the stats at `lo` (lo_cnt, lo_mass) and of the
    keys above `hi` (hi_cnt, hi_mass), and the scratch list state: when `has_list`, the list holds the `list_n` tokens
    with keys in [list_lo, list_hi] and (above_cnt, above_mass) are the stats of the keys above list_hi. `top_key`:
    the row's largest key."""
    j = tl.arange(0, NC)
    while lo < hi:
        covered = (has_list != 0) & (lo >= list_lo) & (hi <= list_hi)
        if _sorts(covered, lo_cnt - hi_cnt, SORT_N):
            lo, lo_cnt, lo_mass, list_lo, list_hi, list_n, above_cnt, above_mass = _sort_step(
                list_x, list_i, m, lo, hi, lo_cnt, lo_mass, hi_cnt, hi_mass, list_lo, list_hi, list_n, above_cnt,
                above_mass, target_count, target_mass, use_mass, SEARCH_BLOCK, SORT_N)
            hi = lo
        else:
            lo, hi, lo_cnt, lo_mass, hi_cnt, hi_mass, has_list, list_lo, list_hi, list_n, above_cnt, above_mass = (
                _search_pass(base, vocab, inv_t, m, list_x, list_i, target_mass, target_count, use_mass, lo, hi,
                             lo_cnt, lo_mass, hi_cnt, hi_mass, has_list, list_lo, list_hi, list_n, above_cnt,
                             above_mass, top_key, covered, j, BLOCK, SEARCH_BLOCK, NC, CAP, VALUE_SPAN, PREFETCH,
                             SORT_N > 0))
    return lo, lo_cnt, lo_mass, has_list, list_lo, list_hi, list_n, above_cnt, above_mass


@triton.jit
def _search_pass(base, vocab, inv_t, m, list_x, list_i, target_mass, target_count, use_mass, lo, hi, lo_cnt,
                 lo_mass, hi_cnt, hi_mass, has_list, list_lo, list_hi, list_n, above_cnt, above_mass, top_key, covered,
                 j, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NC: tl.constexpr, CAP: tl.constexpr,
                 VALUE_SPAN: tl.constexpr, PREFETCH: tl.constexpr, LIST_UP: tl.constexpr):
    """One round of `_search`: NC candidates in (lo, hi] counted (on the list when it covers the interval), the
    interval narrowed to where the answer lies, and the row compacted to the list once the interval fits it (with
    `LIST_UP`, every token from the interval up when they fit)."""
    cands = _candidates(lo, hi, NC, VALUE_SPAN)
    if covered:
        cnt, mass = _stats(list_x, list_n, 1.0, m, cands, SEARCH_BLOCK, NC, PREFETCH)
        cnt += above_cnt
        mass += above_mass
    else:
        cnt, mass = _stats(base, vocab, inv_t, m, cands, SEARCH_BLOCK, NC, PREFETCH)
    ok = tl.where(use_mass, mass >= target_mass, cnt >= target_count)
    n_ok = tl.sum(ok.to(tl.int32), axis=0)  # the stats fall as the candidates rise: ok is a prefix
    if n_ok > 0:
        at = j == n_ok - 1
        lo = _pick(cands, at)
        lo_cnt = _pick(cnt, at)
        lo_mass = _pick(mass, at)
    if n_ok < NC:
        at = j == n_ok
        hi = _pick(cands, at) - 1
        hi_cnt = _pick(cnt, at)
        hi_mass = _pick(mass, at)
    inside = lo_cnt - hi_cnt
    if (lo < hi) & (inside <= CAP) & ((has_list == 0) | (lo < list_lo) | (hi > list_hi)):
        # every token from lo up when they fit (the next phase and the draw then read the list), else the interval
        if LIST_UP & (lo_cnt <= CAP):
            list_hi = top_key
            list_n = lo_cnt
            above_cnt = tl.full([], 0, tl.int32)
            above_mass = tl.full([], 0.0, tl.float32)
        else:
            list_hi = hi
            list_n = inside
            above_cnt = hi_cnt
            above_mass = hi_mass
        _compact(base, vocab, inv_t, lo, list_hi, list_x, list_i, BLOCK)
        has_list = tl.full([], 1, tl.int32)
        list_lo = lo
    return lo, hi, lo_cnt, lo_mass, hi_cnt, hi_mass, has_list, list_lo, list_hi, list_n, above_cnt, above_mass


@triton.jit
def _draw(ptr, idx_ptr, n, scale, m, lo, log_min_p, k1, k2, vocab, INDEXED: tl.constexpr, BLOCK: tl.constexpr):
    """Gumbel-max among the kept tokens of `n` values (a row, or the scratch list with its indices)."""
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], dtype=tl.int32) + vocab
    for start in range(0, n, BLOCK):
        pos = start + cols
        valid = pos < n
        x = tl.load(ptr + pos, mask=valid, other=float("-inf")).to(tl.float32) * scale
        if INDEXED:
            idx = tl.load(idx_ptr + pos, mask=valid, other=0)
        else:
            idx = pos
        bits = _h(_h(idx.to(tl.int64) ^ k1) ^ k2)
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # in (0, 1): see reference_sampling.gumbel
        g = -tl.log(-tl.log(u))
        keep = valid & (_key(x) >= lo) & ((x - m) >= log_min_p)
        score = tl.where(keep, x + g, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_i = tl.where(better, idx, best_i)
    top = tl.max(best, axis=0)
    choice = tl.min(tl.where(best == top, best_i, vocab), axis=0)
    return tl.where(choice >= vocab, 0, choice)


@triton.jit
def _search_and_draw(base, vocab, inv_t, m, list_x, list_i, top_k, top_p, log_min_p, k1, k2, lo, hi, lo_cnt, lo_mass,
                     threshold_ptr, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NC: tl.constexpr,
                     CAP: tl.constexpr, VALUE_SPAN: tl.constexpr, PREFETCH: tl.constexpr,
                     STORE_THRESHOLD: tl.constexpr, SORT_N: tl.constexpr):
    """The kept tokens' threshold by search (top-k, then top-p), then the draw; the row's stats from pass 1."""
    top_key = hi
    has_list = (lo_cnt <= CAP).to(tl.int32)  # a short row: search and draw on a copy of it
    if has_list != 0:
        _compact(base, vocab, inv_t, lo, hi, list_x, list_i, BLOCK)
    list_lo = lo
    list_hi = hi
    list_n = lo_cnt
    zero_i = tl.full([], 0, tl.int32)
    zero_f = tl.full([], 0.0, tl.float32)
    above_cnt = zero_i
    above_mass = zero_f
    # top-k (a count), then top-p (a mass) from where top-k left off: one search body for both (the kernel is
    # compiled at start-up; a second inlined copy of the search cost 1.9 s more of a cold compile on an H100)
    for phase in range(2):
        use_mass = phase == 1
        if use_mass:
            active = top_p < 1.0
        else:
            active = (top_k > 0) & (top_k < vocab)
        if active:
            lo, lo_cnt, lo_mass, has_list, list_lo, list_hi, list_n, above_cnt, above_mass = _search(
                base, vocab, inv_t, m, list_x, list_i, top_p * lo_mass, top_k, use_mass,
                lo, hi, lo_cnt, lo_mass, zero_i, zero_f,
                has_list, list_lo, list_hi, list_n, above_cnt, above_mass, top_key,
                BLOCK, SEARCH_BLOCK, NC, CAP, VALUE_SPAN, PREFETCH, SORT_N)
    if STORE_THRESHOLD:
        tl.store(threshold_ptr, lo)
    # draw: Gumbel-max among kept tokens, on the list when it holds all of them
    if (has_list != 0) & (above_cnt == 0) & (lo >= list_lo):
        choice = _draw(list_x, list_i, list_n, 1.0, m, lo, log_min_p, k1, k2, vocab, True, BLOCK)
    else:
        choice = _draw(base, list_i, vocab, inv_t, m, lo, log_min_p, k1, k2, vocab, False, BLOCK)
    return choice


@triton.jit
def _sample_kernel(logits_ptr, stride, vocab, inv_t_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr, seed_ptr, offset_ptr,
                   out_ptr, list_x_ptr, list_i_ptr, threshold_ptr, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                   NC: tl.constexpr, CAP: tl.constexpr, VALUE_SPAN: tl.constexpr, PREFETCH: tl.constexpr,
                   STORE_THRESHOLD: tl.constexpr, DRAW_FIRST_ROUNDS: tl.constexpr,
                   DRAW_FIRST_MIN_P: tl.constexpr, SORT_N: tl.constexpr, SKIP_DECIDED: tl.constexpr):
    row = tl.program_id(0)
    if SKIP_DECIDED:  # the top-k fast path decided the rows whose token is already in `out` (>= 0)
        todo = tl.load(out_ptr + row) < 0
    else:
        todo = True
    if todo:
        _sample_row(row, logits_ptr, stride, vocab, inv_t_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr, seed_ptr,
                    offset_ptr, out_ptr, list_x_ptr, list_i_ptr, threshold_ptr, BLOCK, SEARCH_BLOCK, NC, CAP,
                    VALUE_SPAN, PREFETCH, STORE_THRESHOLD, DRAW_FIRST_ROUNDS, DRAW_FIRST_MIN_P, SORT_N)


@triton.jit
def _sample_row(row, logits_ptr, stride, vocab, inv_t_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr, seed_ptr, offset_ptr,
                out_ptr, list_x_ptr, list_i_ptr, threshold_ptr, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                NC: tl.constexpr, CAP: tl.constexpr, VALUE_SPAN: tl.constexpr, PREFETCH: tl.constexpr,
                STORE_THRESHOLD: tl.constexpr, DRAW_FIRST_ROUNDS: tl.constexpr, DRAW_FIRST_MIN_P: tl.constexpr,
                SORT_N: tl.constexpr):
    """One row of `_sample_kernel`: its greedy pick, or its search and draw."""
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
        list_x = list_x_ptr + row.to(tl.int64) * CAP
        list_i = list_i_ptr + row.to(tl.int64) * CAP
        # pass 1: max, finite min, and the softmax mass (online: per-lane max and rescaled sum)
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        mn = tl.full([BLOCK], float("inf"), tl.float32)
        z = tl.zeros([BLOCK], dtype=tl.float32)
        n_fin = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            valid = idx < vocab
            x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            finite = x > float("-inf")
            new_mx = tl.maximum(mx, x)
            z = tl.where(finite, z * tl.exp(mx - new_mx) + tl.exp(x - new_mx), z)
            mx = new_mx
            mn = tl.minimum(mn, tl.where(finite, x, float("inf")))
            n_fin += finite.to(tl.int32)
        m = tl.max(mx, axis=0)
        z_total = tl.sum(tl.where(mx > float("-inf"), z * tl.exp(mx - m), 0.0), axis=0)
        lo = _key(tl.min(mn, axis=0))
        hi = _key(m)
        lo_cnt = tl.sum(n_fin, axis=0)
        lo_mass = z_total
        k = _h(((off >> 32) & 0xFFFFFFFF) ^ 0x9E3779B9)
        k = _h((off & 0xFFFFFFFF) ^ k)
        k = _h(((seed >> 32) & 0xFFFFFFFF) ^ k)
        k1 = _h((seed & 0xFFFFFFFF) ^ k)
        k2 = _h(k1 ^ 0x85EBCA6B)
        choice = tl.full([], -1, tl.int32)
        if DRAW_FIRST_ROUNDS > 0:
            # top-p without top-k: draw first, then check. A token is kept iff the mass of the keys above its own is
            # < p * Z (the module docstring's threshold, seen from the token), and the kept tokens are the keys from
            # some threshold up, min-p included. So the Gumbel-max over the keys >= `bound` (a bound below the
            # threshold) is the draw over the kept tokens when it is kept itself; when it is not, the threshold lies
            # above its key, which becomes the new bound. Each round is two row passes; with p = 0.95 the first
            # draw is kept about 95 % of the time, where the search takes several passes of NC candidates each.
            if ((top_k <= 0) | (top_k >= vocab)) & (top_p < 1.0) & (top_p >= DRAW_FIRST_MIN_P):
                bound = lo
                target = top_p * lo_mass
                for _ in range(DRAW_FIRST_ROUNDS):
                    if choice < 0:
                        c = _draw(base, list_i, vocab, inv_t, m, bound, log_min_p, k1, k2, vocab, False, BLOCK)
                        kc = _key(tl.load(base + c).to(tl.float32) * inv_t)
                        if _mass_above(base, vocab, inv_t, m, kc, SEARCH_BLOCK) < target:
                            choice = c
                        else:
                            bound = kc + 1
        if choice < 0:
            choice = _search_and_draw(base, vocab, inv_t, m, list_x, list_i, top_k, top_p, log_min_p, k1, k2,
                                      lo, hi, lo_cnt, lo_mass, threshold_ptr + row, BLOCK, SEARCH_BLOCK, NC, CAP,
                                      VALUE_SPAN, PREFETCH, STORE_THRESHOLD, SORT_N)
        tl.store(out_ptr + row, choice.to(tl.int64))


def default_sort_n() -> int:
    """`sort_n` when not given: `SORT_N`, or `INTERPRETED_SORT_N` under Triton's interpreter (`TRITON_INTERPRET`,
    read at each call, so that tests may change it between calls)."""
    return INTERPRETED_SORT_N if triton_interpreting() else SORT_N


def sample_tokens(logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  log_min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, *, cap: int = CAP,
                  block: int = BLOCK, search_block: int = SEARCH_BLOCK, num_warps: int = NUM_WARPS,
                  prefetch: bool = PREFETCH, thresholds: torch.Tensor | None = None,
                  draw_first_rounds: int = DRAW_FIRST_ROUNDS, draw_first_min_p: float = DRAW_FIRST_MIN_P,
                  sort_n: int | None = None, decided: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids ``[R]`` of ``logits [R, V]`` (see the module docstring); ``cap``, ``block``, ``search_block``
    (powers of two), ``num_warps``, ``prefetch``, ``draw_first_rounds`` (0: always search), ``draw_first_min_p`` and
    ``sort_n`` (0, or a power of two >= 16: the most tokens `_select` sorts; 0: the search alone; None: `SORT_N`, or
    `INTERPRETED_SORT_N` under the interpreter) are tuning knobs that never change a token. ``thresholds`` (``[R]``
    int32, for tests): receives each sampled row's top-k / top-p threshold key, as `reference_sampling.kept_threshold`
    defines it (every row then searches). ``decided`` (``[R]`` int64, the top-k fast path's `triton_topk_sampling`):
    rows holding a token (>= 0) are left as they are, the others (-1) sampled; it is filled in and returned."""
    if sort_n is None:
        sort_n = default_sort_n()
    sort_n = int(sort_n)
    if sort_n and (sort_n < 16 or sort_n & (sort_n - 1)):
        raise ValueError(f"sort_n must be 0 or a power of two >= 16, got {sort_n}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device) if decided is None else decided
    if rows == 0:
        return out
    list_x = torch.empty((rows, cap), dtype=torch.float32, device=logits.device)
    list_i = torch.empty((rows, cap), dtype=torch.int32, device=logits.device)
    _sample_kernel[(rows,)](logits, logits.stride(0), vocab, inv_t, top_k, top_p, log_min_p, seed, offset, out,
                            list_x, list_i, out if thresholds is None else thresholds, BLOCK=block, SEARCH_BLOCK=search_block, NC=NC, CAP=cap,
                            VALUE_SPAN=_VALUE_SPAN, PREFETCH=prefetch,
                            STORE_THRESHOLD=thresholds is not None,
                            DRAW_FIRST_ROUNDS=0 if thresholds is not None else int(draw_first_rounds),
                            DRAW_FIRST_MIN_P=float(draw_first_min_p), SORT_N=sort_n,
                            SKIP_DECIDED=decided is not None, num_warps=num_warps, enable_fp_fusion=False)
    return out
