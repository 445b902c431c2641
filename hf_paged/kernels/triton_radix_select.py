"""Each row's ``count`` largest logits in Triton, as ``torch.topk(logits, count)`` (sorted) hands them to the top-k
fast path's candidate kernel (:mod:`hf_paged.kernels.triton_topk_sampling`), reading each row twice.

Why: on an H200, ``torch.topk`` of 240 bf16 rows of 262,144 (count 128) took 547 of the fast path's 557 us, while one
read of those rows (126 MB) takes about 30 us. An 8-bit radix select alone reads a bf16 row three times and a float32
row five, and its histograms (``tl.histogram``: ballots and popcounts, ~100 instructions a warp per 32 elements) cost
more than the reads; so the radix passes only take the rows a cheap bound leaves too many candidates:

1. keys: every logit's raw bits become an order-preserving signed key (`_skey`: 16 bits for bf16 / fp16, 32 for
   float32; negatives' magnitude bits flipped, so -0.0 sits just below +0.0; every NaN the largest key, as
   ``torch.topk`` ranks NaN first);
2. bound (`_group_max_kernel`, `_bound_kernel`): the row's maximum key in each group of ``group`` consecutive
   elements (``M`` groups, about ``4 * count``), then ``L`` = the ``count``-th largest of those maxima: ``count``
   distinct elements reach it, so the ``count``-th largest key is ``>= L``. On random rows about ``-M ln(1 - count /
   M)`` keys reach ``L`` (1.15 ``count``), on any row at most ``group`` per group above it;
3. compaction (`_compact_kernel`): every key ``>= L`` but -inf (all the row's ``count`` largest and every key tied
   with the ``count``-th, or, where ``L`` is -inf, every key above it) is appended, with its index, to the row's list
   of ``cap`` slots (an atomic counter);
4. rows whose list overflowed (``n > cap``: ties, e.g. a flat row, or masks leaving more than ``cap`` tokens) take the
   exact radix
   select, the other rows' programs return at once: ``KEY_BITS / 8`` histogram passes (`_hist_kernel`, 8-bit
   digits from the top; every program re-reads its row's earlier histograms, `_walk`, for the prefix found so far)
   and a gather (`_gather_kernel`) of the keys above the ``count``-th and enough equal to it into the list;
5. `_final_kernel`, one program a row: sorts the list (key, then index, packed in int64; in a quarter of the list's
   tile when it fits, as it usually does) and writes its first ``count``: indices (int32) and the values read back
   at them (the logits' dtype, their own bits). A list shorter than ``count`` holds every key of its row but -inf
   (a mask left fewer than ``count`` tokens): the row's least-index -inf elements follow it, found by a scan from the
   row's start (at most ``count`` plus the list's length elements).

Why -inf stays out of the list: a row masked to a few tokens (a grammar's, min-p's) has fewer than ``count`` groups
above -inf, so ``L`` is -inf; counting its -inf keys overflowed the list and sent the row through every radix pass
(2.5-2.9x ``torch.topk``'s time on an H200, 240 such rows).

The rows are cut into chunks of ``chunk`` elements, one program each (grid ``rows x chunks``), so one row or 240 fill
the SMs alike (`chunk_size`). The output is torch.topk's, up to what torch.topk leaves open: equal values come by
index; a row whose list did not overflow takes the least indices among the keys tied at the ``count``-th
(`reference_select.select_top`'s answer, exactly); an overflowed row takes the tied keys in the order its programs
reach the gather's counter (any on the GPU). The candidate kernel does not depend on that choice (it decides a row
only when the k-th value lies above the list's last, so every token it can keep lies above the tie; it reads
indices through minimums), nor on -0.0 against +0.0 (a zero in the kept set leaves the row to the full kernel).

No host sync, a fixed number of launches whatever the logits (safe under CUDA-graph capture); scratch: one zeroed
int32 buffer (histograms, counters, the bound) and two uninitialised ones a call. Imported lazily (needs triton).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .interpreter import triton_interpreting

BINS = 256  # 8-bit digits of the radix passes
BLOCK = 2048  # elements a tile
NUM_WARPS = 8
# chunks of a row (one program each): enough programs for about PROGRAMS_PER_SM per SM over all rows, each reading at
# least a tile and at most MAX_CHUNK elements (one row of 262,144 bf16: 128 programs of one tile; 240 rows: 4 chunks
# of 65,536 a row, 960 programs)
PROGRAMS_PER_SM = 4
MAX_CHUNK = 1 << 16
GROUPS_PER_COUNT = 4  # groups of the bound, about this many per candidate: ~1.15 count keys reach it on random rows
CAP_PER_COUNT = 8  # list slots a row per candidate (power of two, MIN_CAP..MAX_CAP): more rows skip the radix passes,
MIN_CAP = 256  # but the final sort is of `cap` keys
MAX_CAP = 4096
_SCRATCH_TAIL = 4  # after a row's histograms: the gather's two counters, the list's counter, the bound
_RAW = {torch.float32: (torch.int32, 32, 0x7F800000), torch.bfloat16: (torch.int16, 16, 0x7F80),
        torch.float16: (torch.int16, 16, 0x7C00)}  # dtype -> (bits' dtype, key bits, the bits of +inf)


@triton.jit
def _skey(b, KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr):
    """Signed order-preserving key (int32) of raw float bits ``b`` (int32, sign-extended from 16 bits): a negative's
    magnitude bits flipped (so -0.0 sits just below +0.0), every NaN the largest key."""
    MAG: tl.constexpr = (1 << (KEY_BITS - 1)) - 1
    key = tl.where(b < 0, b ^ MAG, b)
    return tl.where((b & MAG) > INF_BITS, MAG, key)


@triton.jit
def _row_keys(bits_ptr, row, row_stride, idx, vocab, KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr):
    """Keys of a row's elements ``idx``; INT32_MIN (below every key) past the row's end."""
    valid = idx < vocab
    raw = tl.load(bits_ptr + row.to(tl.int64) * row_stride + idx, mask=valid, other=0)
    return tl.where(valid, _skey(raw.to(tl.int32), KEY_BITS, INF_BITS), -2147483648)


@triton.jit
def _pack(key, idx):
    """(key, index) in one int64 whose order is the key's, then the lesser index first."""
    return (key.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)


@triton.jit
def _group_max_kernel(bits_ptr, row_stride, vocab, chunk, groups_ptr, n_groups, KEY_BITS: tl.constexpr,
                      INF_BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    cols = tl.arange(0, BLOCK)
    out = groups_ptr + row.to(tl.int64) * n_groups
    for off in range(start, tl.minimum(start + chunk, vocab), BLOCK):
        key = _row_keys(bits_ptr, row, row_stride, off + cols, vocab, KEY_BITS, INF_BITS)
        top = tl.max(tl.reshape(key, [BLOCK // GROUP, GROUP]), axis=1)
        g = off // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(out + g, top, mask=g < n_groups)


@triton.jit(do_not_specialize=["count"])
def _bound_kernel(groups_ptr, n_groups, count, scratch_ptr, SCRATCH: tl.constexpr, BOUND_AT: tl.constexpr,
                  GROUPS: tl.constexpr, SORT: tl.constexpr):
    row = tl.program_id(0)
    pos = tl.arange(0, GROUPS)
    top = tl.load(groups_ptr + row.to(tl.int64) * n_groups + pos, mask=pos < n_groups, other=-2147483648)
    if SORT:
        top = tl.sort(top, descending=True)
        bound = tl.sum(tl.where(pos == count - 1, top, 0), axis=0)
    else:  # (the interpreter: its bitonic sort runs op by op in Python) the value with fewer than `count` above it
        above = tl.sum((top[None, :] > top[:, None]).to(tl.int32), axis=1)
        at_least = tl.sum((top[None, :] >= top[:, None]).to(tl.int32), axis=1)
        bound = tl.max(tl.where((above < count) & (at_least >= count), top, -2147483648), axis=0)
    # fewer groups than `count`: INT32_MIN, every key
    tl.store(scratch_ptr + row * SCRATCH + BOUND_AT, tl.where(count <= n_groups, bound, -2147483648))


@triton.jit
def _compact_kernel(bits_ptr, row_stride, vocab, chunk, scratch_ptr, list_ptr, KEY_BITS: tl.constexpr,
                    INF_BITS: tl.constexpr, NEG_INF_KEY: tl.constexpr, SCRATCH: tl.constexpr, BOUND_AT: tl.constexpr,
                    CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    cols = tl.arange(0, BLOCK)
    # the bound, but never -inf: a masked row's -inf keys stay out of the list (`_final_kernel` adds what it needs)
    bound = tl.maximum(tl.load(scratch_ptr + row * SCRATCH + BOUND_AT), NEG_INF_KEY + 1)
    counter = scratch_ptr + row * SCRATCH + BOUND_AT - 1
    out = list_ptr + row.to(tl.int64) * CAP
    for off in range(start, tl.minimum(start + chunk, vocab), BLOCK):
        idx = off + cols
        key = _row_keys(bits_ptr, row, row_stride, idx, vocab, KEY_BITS, INF_BITS)
        hit = (key >= bound) & (idx < vocab)
        n = tl.sum(hit.to(tl.int32), axis=0)
        if n > 0:  # most tiles hold none of the row's largest
            slot = tl.atomic_add(counter, n, sem="relaxed") + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            tl.store(out + slot, _pack(key, idx), mask=hit & (slot < CAP))


@triton.jit
def _walk(hist_ptr, count, PASSES: tl.constexpr, BINS: tl.constexpr):
    """From a row's histograms of passes ``0..PASSES-1``: the prefix (int64, the digits found so far) of the bucket
    that holds the row's ``count``-th largest key, and how many of that bucket's keys are among the ``count``."""
    bins = tl.arange(0, BINS)
    rem = count
    prefix = count.to(tl.int64) * 0
    for p in tl.static_range(PASSES):
        h = tl.load(hist_ptr + p * BINS + bins)
        at_least = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys in this bin or above
        d = tl.max(tl.where(at_least >= rem, bins, -1), axis=0)  # the highest bin still reaching `rem`
        rem = rem - tl.sum(tl.where(bins > d, h, 0), axis=0)
        prefix = prefix * BINS + d
    return prefix, rem


@triton.jit(do_not_specialize=["count"])
def _hist_kernel(bits_ptr, row_stride, vocab, count, chunk, scratch_ptr, PASS: tl.constexpr, KEY_BITS: tl.constexpr,
                 INF_BITS: tl.constexpr, SCRATCH: tl.constexpr, BOUND_AT: tl.constexpr, CAP: tl.constexpr,
                 BLOCK: tl.constexpr, BINS: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    hist = scratch_ptr + row * SCRATCH
    if tl.load(hist + BOUND_AT - 1) > CAP:  # only rows whose list overflowed
        prefix, rem = _walk(hist, count, PASS, BINS)
        # the bucket of keys sharing the prefix, in signed keys: [lo, hi]
        SHIFT: tl.constexpr = KEY_BITS - 8 * (PASS + 1)
        lo = ((prefix << (SHIFT + 8)) - (1 << (KEY_BITS - 1))).to(tl.int32)
        hi = ((prefix << (SHIFT + 8)) + ((1 << (SHIFT + 8)) - 1) - (1 << (KEY_BITS - 1))).to(tl.int32)
        cols = tl.arange(0, BLOCK)
        acc = tl.zeros([BINS], dtype=tl.int32)
        for off in range(start, tl.minimum(start + chunk, vocab), BLOCK):
            idx = off + cols
            key = _row_keys(bits_ptr, row, row_stride, idx, vocab, KEY_BITS, INF_BITS)
            valid = idx < vocab
            digit = (key >> SHIFT) & (BINS - 1)
            if PASS == 0:
                digit = digit ^ (BINS // 2)  # the top digit of the unsigned key: the sign bit flipped back
            else:
                valid = valid & (key >= lo) & (key <= hi)
            acc += tl.histogram(digit, BINS, mask=valid)
        tl.atomic_add(hist + PASS * BINS + tl.arange(0, BINS), acc, mask=acc > 0, sem="relaxed")


@triton.jit(do_not_specialize=["count"])
def _gather_kernel(bits_ptr, row_stride, vocab, count, chunk, scratch_ptr, list_ptr, PASSES: tl.constexpr,
                   KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr, SCRATCH: tl.constexpr, BOUND_AT: tl.constexpr,
                   CAP: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    hist = scratch_ptr + row * SCRATCH
    if tl.load(hist + BOUND_AT - 1) > CAP:  # only rows whose list overflowed: their list is rewritten
        prefix, ties = _walk(hist, count, PASSES, BINS)
        threshold = (prefix - (1 << (KEY_BITS - 1))).to(tl.int32)  # the count-th largest key
        above = count - ties  # keys > threshold: slots [0, above); `ties` keys == threshold take [above, count)
        counters = hist + PASSES * BINS
        cols = tl.arange(0, BLOCK)
        out = list_ptr + row.to(tl.int64) * CAP
        for off in range(start, tl.minimum(start + chunk, vocab), BLOCK):
            idx = off + cols
            key = _row_keys(bits_ptr, row, row_stride, idx, vocab, KEY_BITS, INF_BITS)
            hit = (key >= threshold) & (idx < vocab)
            if tl.sum(hit.to(tl.int32), axis=0) > 0:
                gt = hit & (key > threshold)
                n_gt = tl.sum(gt.to(tl.int32), axis=0)
                if n_gt > 0:
                    slot = tl.atomic_add(counters, n_gt, sem="relaxed") + tl.cumsum(gt.to(tl.int32), axis=0) - 1
                    tl.store(out + slot, _pack(key, idx), mask=gt)
                eq = hit & (key == threshold)
                n_eq = tl.sum(eq.to(tl.int32), axis=0)
                if n_eq > 0:
                    slot = tl.atomic_add(counters + 1, n_eq, sem="relaxed") + tl.cumsum(eq.to(tl.int32), axis=0) - 1
                    tl.store(out + above + slot, _pack(key, idx), mask=eq & (slot < ties))


@triton.jit
def _write_sorted(list_ptr, n, count, row, bits_ptr, row_stride, out_bits_ptr, out_idx_ptr, TILE: tl.constexpr,
                  CAP: tl.constexpr, SORT: tl.constexpr):
    """The row's list (its first ``n <= TILE`` entries) sorted from the largest; its first ``count`` written."""
    pos = tl.arange(0, TILE)
    packed = tl.load(list_ptr + row.to(tl.int64) * CAP + pos, mask=pos < n, other=-9223372036854775808)
    if SORT:
        packed = tl.sort(packed, descending=True)
    else:  # (the interpreter) each entry to its rank: the packed values are distinct, but for the padding past `n`
        rank = tl.sum((packed[None, :] > packed[:, None]).to(tl.int32), axis=1)
        pos = tl.where(pos < n, rank, TILE)
    idx = 2147483647 - (packed & 0xFFFFFFFF).to(tl.int32)
    keep = (pos < count) & (pos < n)  # (a list may be shorter than `count`: `_final_kernel` writes the rest)
    # the values read back from the row by index: its own bits (NaN payloads, signed zeros), not rebuilt from keys
    value = tl.load(bits_ptr + row.to(tl.int64) * row_stride + idx, mask=keep, other=0)
    tl.store(out_bits_ptr + row.to(tl.int64) * count + pos, value, mask=keep)
    tl.store(out_idx_ptr + row.to(tl.int64) * count + pos, idx, mask=keep)


@triton.jit(do_not_specialize=["count"])
def _final_kernel(list_ptr, count, vocab, scratch_ptr, bits_ptr, row_stride, out_bits_ptr, out_idx_ptr,
                  KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr, NEG_INF_KEY: tl.constexpr, SCRATCH: tl.constexpr,
                  BOUND_AT: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr, SORT: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(scratch_ptr + row * SCRATCH + BOUND_AT - 1)
    n = tl.where(n > CAP, count, n)  # an overflowed row: the gather wrote its `count`
    # a list usually holds little more than `count` (the module docstring): a tile of SMALL sorts it faster
    if n <= SMALL:
        _write_sorted(list_ptr, n, count, row, bits_ptr, row_stride, out_bits_ptr, out_idx_ptr, SMALL, CAP, SORT)
    else:
        _write_sorted(list_ptr, n, count, row, bits_ptr, row_stride, out_bits_ptr, out_idx_ptr, CAP, CAP, SORT)
    if n < count:  # the list is every key of the row but -inf: its least-index -inf elements follow, in index order
        cols = tl.arange(0, BLOCK)
        found = n * 0
        off = n * 0
        while (found < count - n) & (off < vocab):
            idx = off + cols
            tie = (_row_keys(bits_ptr, row, row_stride, idx, vocab, KEY_BITS, INF_BITS) == NEG_INF_KEY) & (idx < vocab)
            pos = n + found + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            keep = tie & (pos < count)
            value = tl.load(bits_ptr + row.to(tl.int64) * row_stride + idx, mask=keep, other=0)
            tl.store(out_bits_ptr + row.to(tl.int64) * count + pos, value, mask=keep)
            tl.store(out_idx_ptr + row.to(tl.int64) * count + pos, idx, mask=keep)
            found += tl.sum(tie.to(tl.int32), axis=0)
            off += BLOCK


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def neg_inf_key(key_bits: int, inf_bits: int) -> int:
    """The key of -inf (`_skey` of its bits, sign-extended from `key_bits`)."""
    raw = ((1 << (key_bits - 1)) | inf_bits) - (1 << key_bits)
    return raw ^ ((1 << (key_bits - 1)) - 1)


def chunk_size(rows: int, vocab: int, device: torch.device, block: int) -> int:
    """Elements a program reads (a power-of-two multiple of ``block``): about `PROGRAMS_PER_SM` programs per SM over
    all rows, at most `MAX_CHUNK`; on the CPU (interpreter) chunks of at most 4 tiles."""
    if device.type != "cuda":
        return block * min(4, triton.cdiv(vocab, block))
    sms = _sms(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(rows * vocab, sms * PROGRAMS_PER_SM)
    return max(block, min(max(MAX_CHUNK, block), triton.next_power_of_2(want)))


def group_size(vocab: int, count: int, block: int) -> int:
    """Elements a group of the bound (a power of two up to ``block``): about `GROUPS_PER_COUNT` groups per
    candidate (Gemma's 262,144 at count 128: 512 groups of 512)."""
    g = max(1, vocab // (GROUPS_PER_COUNT * count))
    return min(block, 1 << (g.bit_length() - 1))


def list_cap(count: int) -> int:
    """Slots of a row's list: `CAP_PER_COUNT` a candidate, a power of two in ``[MIN_CAP, MAX_CAP]``."""
    return min(MAX_CAP, max(MIN_CAP, triton.next_power_of_2(CAP_PER_COUNT * count)))


def variant(vocab: int, count: int, block: int = BLOCK) -> tuple[int, int, int, int]:
    """The compile-time sizes a default `select_top` call over rows of `vocab` takes at `count`: the group, the
    groups' tile, the list and its small sort tile. Calls with equal variants run the same compiled kernels (the
    other arguments are runtime values, or sized alike: powers of two, or fixed per vocabulary)."""
    count = min(count, vocab)
    group, cap = group_size(vocab, count, block), list_cap(count)
    return group, triton.next_power_of_2(triton.cdiv(vocab, group)), cap, small_tile(count, cap)


def small_tile(count: int, cap: int) -> int:
    """The final kernel's small sort tile: a quarter of the list, at least `count` (a power of two)."""
    return min(cap, max(triton.next_power_of_2(count), cap // 4))


def warm_up(vocab: int, dtype: torch.dtype, device: torch.device, counts) -> list[int]:
    """Compile the selection for every variant among `counts` (what the sampler can ask for: one count per top-k
    bound) over rows of `vocab` logits of `dtype`, by one call each on a row of zeros (a tied row: it overflows, so
    every kernel runs); returns the counts called. Why: a variant compiles seven kernels at its first call, which a
    served step would otherwise wait for (7 s at top-k 64 on an H200 when the warm-up sampled at top-k 2 only)."""
    seen, called = set(), []
    for count in counts:
        key = variant(vocab, count)
        if key not in seen:
            seen.add(key)
            called.append(count)
            select_top(torch.zeros(1, vocab, dtype=dtype, device=device), count)
    return called


def select_top(logits: torch.Tensor, count: int, *, block: int | None = None, chunk: int | None = None,
               group: int | None = None, cap: int | None = None, num_warps: int | None = None,
               sort: bool | None = None, sizes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, min(count, V), dim=1)``'s values (the logits' dtype) and indices (int32), sorted from the
    largest, equal values by index, of ``logits [R, V]`` (float32 / bf16 / fp16); module docstring. ``block``,
    ``chunk``, ``group``, ``cap``: a tile, a program's part of a row, a group of the bound and a row's list (powers
    of two; ``chunk`` a multiple of ``block`` and ``block`` of ``group``; ``cap >= count``), chosen when None (from
    the module's knobs as they are at the call: a sweep may set them).
    ``sort``: order the bound's groups and the list with ``tl.sort`` (by default unless interpreting: the
    interpreter's sort takes a second a row; the other way counts, for each entry, the entries above it).
    ``sizes`` (``[R]`` int32, optional): receives each row's list length, the keys but -inf that reached its bound
    (above ``cap``: the row took the radix passes), for tests and benchmarks."""
    rows, vocab = logits.shape
    count = min(count, vocab)
    raw_dtype, key_bits, inf_bits = _RAW[logits.dtype]
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    passes = key_bits // 8
    bound_at = passes * BINS + _SCRATCH_TAIL - 1
    scratch_width = passes * BINS + _SCRATCH_TAIL
    out_bits = torch.empty(rows, count, dtype=raw_dtype, device=dev)
    out_idx = torch.empty(rows, count, dtype=torch.int32, device=dev)
    if rows and count:
        block = block or BLOCK
        num_warps = num_warps or NUM_WARPS
        chunk = chunk or chunk_size(rows, vocab, dev, block)
        group = group or group_size(vocab, count, block)
        cap = cap or list_cap(count)
        sort = not triton_interpreting() if sort is None else sort
        if chunk % block or block % group or cap < count:
            raise ValueError(f"chunk {chunk}, block {block}, group {group}, cap {cap} at count {count}")
        n_groups = triton.cdiv(vocab, group)
        scratch = torch.zeros(rows, scratch_width, dtype=torch.int32, device=dev)
        groups = torch.empty(rows, n_groups, dtype=torch.int32, device=dev)
        lists = torch.empty(rows, cap, dtype=torch.int64, device=dev)
        bits = logits.view(raw_dtype)
        grid = (rows, triton.cdiv(vocab, chunk))
        keys = dict(KEY_BITS=key_bits, INF_BITS=inf_bits)
        neg_inf = dict(NEG_INF_KEY=neg_inf_key(key_bits, inf_bits))
        _group_max_kernel[grid](bits, bits.stride(0), vocab, chunk, groups, n_groups, **keys, GROUP=group,
                                BLOCK=block, num_warps=num_warps)
        _bound_kernel[(rows,)](groups, n_groups, count, scratch, SCRATCH=scratch_width, BOUND_AT=bound_at,
                               GROUPS=triton.next_power_of_2(n_groups), SORT=sort, num_warps=num_warps)
        layout = dict(SCRATCH=scratch_width, BOUND_AT=bound_at, CAP=cap, BLOCK=block)
        _compact_kernel[grid](bits, bits.stride(0), vocab, chunk, scratch, lists, **keys, **neg_inf, **layout,
                              num_warps=num_warps)
        for p in range(passes):
            _hist_kernel[grid](bits, bits.stride(0), vocab, count, chunk, scratch, PASS=p, **keys, **layout,
                               BINS=BINS, num_warps=num_warps)
        _gather_kernel[grid](bits, bits.stride(0), vocab, count, chunk, scratch, lists, PASSES=passes, **keys,
                             **layout, BINS=BINS, num_warps=num_warps)
        small = small_tile(count, cap)
        _final_kernel[(rows,)](lists, count, vocab, scratch, bits, bits.stride(0), out_bits, out_idx, **keys, **neg_inf,
                               SCRATCH=scratch_width, BOUND_AT=bound_at, CAP=cap, SMALL=small, SORT=sort,
                               BLOCK=block, num_warps=num_warps)
        if sizes is not None:
            sizes.copy_(scratch[:, bound_at - 1])
    return out_bits.view(logits.dtype), out_idx
