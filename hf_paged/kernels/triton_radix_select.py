"""Each row's ``count`` largest logits by a radix select in Triton: what ``torch.topk(logits, count)`` (sorted) hands
the top-k fast path's candidate kernel (:mod:`hf_paged.kernels.triton_topk_sampling`), reading each row a few times.

Why: on an H200, ``torch.topk`` of 240 bf16 rows of 262,144 (count 128) took 547 of the fast path's 557 us, while one
read of those rows (126 MB) takes about 30 us. A radix select reads the row once per digit of the key, then once to
gather:

1. every logit's raw bits become an order-preserving signed key (`_skey`: 16 bits for bf16 / fp16, 32 for float32;
   negatives' magnitude bits flipped; every NaN the largest key, as ``torch.topk`` and ``torch.sort`` put NaN first);
2. ``KEY_BITS / 8`` histogram passes (`_hist_kernel`), 8 bits each from the top: a pass counts, per row, the 256
   values of its digit among the keys whose higher digits are the prefix found so far. Every program first re-reads
   the earlier passes' histograms of its row (`_walk`: a 256-wide cumulative sum each) to get that prefix and how
   many of the bucket's keys are still needed; no state but the histograms, no extra launch to combine them;
3. one gather pass (`_gather_kernel`): each key above the threshold (the ``count``-th largest key) takes a slot of
   ``[0, n_above)`` and enough keys equal to it take the slots up to ``count`` (both by a per-row atomic counter);
4. ``torch.sort`` of the ``[R, count]`` values (small) and the matching indices.

A row is cut into chunks of ``chunk`` elements, one program each (grid ``rows x chunks``), so one row or 240 fill
the SMs alike (`chunk_size`: about `PROGRAMS_PER_SM` programs per SM); the chunks of a row add their histograms into
global memory with atomics (256 adds a program and pass at most, against the thousands of elements it reads).

The output is torch.topk's, up to what torch.topk leaves arbitrary: which of the keys tied at the threshold are
taken, and the order of equal values. The candidate kernel does not depend on either (it decides a row only when the
k-th value lies above the list's last, so every token it can keep is above the threshold; and among equal values
only their indices differ, which it reads through minimums; `reference_sampling.candidate_tokens`), and -0.0 and
+0.0, which keys order and floats tie, are never in a decided row's kept set. Here the tied keys are taken in the
order the programs reach the counter: not deterministic on the GPU, deterministic in the tokens.

No host sync, a fixed number of launches whatever the logits (safe under CUDA-graph capture); the scratch (the
histograms and two counters a row) is one zeroed buffer a call. Imported lazily (needs triton).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BINS = 256  # 8-bit digits: a pass's histogram fits every program's registers, 4 passes cover float32
BLOCK = 2048  # elements a tile (one `tl.histogram`)
NUM_WARPS = 8
# chunks of a row (one program each): enough programs for about PROGRAMS_PER_SM per SM over all rows, each reading at
# least a tile and at most MAX_CHUNK elements (one row of 262,144 bf16: 128 programs of one tile; 240 rows: 4 chunks
# of 65,536 a row, 960 programs)
PROGRAMS_PER_SM = 4
MAX_CHUNK = 1 << 16
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


# one compiled variant a pass and dtype whatever the shape (the chunk is a loop bound, not a tile)
@triton.jit(do_not_specialize=["row_stride", "vocab", "count", "chunk"])
def _hist_kernel(bits_ptr, row_stride, vocab, count, chunk, scratch_ptr, PASS: tl.constexpr, KEY_BITS: tl.constexpr,
                 INF_BITS: tl.constexpr, SCRATCH: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    hist = scratch_ptr + row * SCRATCH
    prefix, rem = _walk(hist, count, PASS, BINS)
    # the bucket of keys sharing the prefix, in signed keys: [lo, lo + 2**(shift + 8) - 1]
    SHIFT: tl.constexpr = KEY_BITS - 8 * (PASS + 1)
    lo = ((prefix << (SHIFT + 8)) - (1 << (KEY_BITS - 1))).to(tl.int32)
    hi = ((prefix << (SHIFT + 8)) + ((1 << (SHIFT + 8)) - 1) - (1 << (KEY_BITS - 1))).to(tl.int32)
    cols = tl.arange(0, BLOCK)
    base = bits_ptr + row.to(tl.int64) * row_stride
    acc = tl.zeros([BINS], dtype=tl.int32)
    for off in range(start, tl.minimum(start + chunk, vocab), BLOCK):
        idx = off + cols
        valid = idx < vocab
        key = _skey(tl.load(base + idx, mask=valid, other=0).to(tl.int32), KEY_BITS, INF_BITS)
        digit = (key >> SHIFT) & (BINS - 1)
        if PASS == 0:
            digit = digit ^ (BINS // 2)  # the top digit of the unsigned key: the sign bit flipped back
        else:
            valid = valid & (key >= lo) & (key <= hi)
        acc += tl.histogram(digit, BINS, mask=valid)
    tl.atomic_add(hist + PASS * BINS + tl.arange(0, BINS), acc, mask=acc > 0, sem="relaxed")


@triton.jit(do_not_specialize=["row_stride", "vocab", "count", "chunk"])
def _gather_kernel(bits_ptr, row_stride, vocab, count, chunk, scratch_ptr, out_bits_ptr, out_idx_ptr,
                   PASSES: tl.constexpr, KEY_BITS: tl.constexpr, INF_BITS: tl.constexpr, SCRATCH: tl.constexpr,
                   BLOCK: tl.constexpr, BINS: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * chunk
    hist = scratch_ptr + row * SCRATCH
    prefix, ties = _walk(hist, count, PASSES, BINS)
    threshold = (prefix - (1 << (KEY_BITS - 1))).to(tl.int32)  # the count-th largest key
    above = count - ties  # keys > threshold: slots [0, above); `ties` keys == threshold take [above, count)
    counters = hist + PASSES * BINS
    cols = tl.arange(0, BLOCK)
    base = bits_ptr + row.to(tl.int64) * row_stride
    out_bits = out_bits_ptr + row.to(tl.int64) * count
    out_idx = out_idx_ptr + row.to(tl.int64) * count
    for off in range(start, tl.minimum(start + chunk, vocab), BLOCK):
        idx = off + cols
        valid = idx < vocab
        raw = tl.load(base + idx, mask=valid, other=0)
        key = _skey(raw.to(tl.int32), KEY_BITS, INF_BITS)
        hit = valid & (key >= threshold)
        if tl.sum(hit.to(tl.int32), axis=0) > 0:  # most tiles hold none of the row's largest
            gt = hit & (key > threshold)
            n_gt = tl.sum(gt.to(tl.int32), axis=0)
            if n_gt > 0:
                slot = tl.atomic_add(counters, n_gt, sem="relaxed") + tl.cumsum(gt.to(tl.int32), axis=0) - 1
                tl.store(out_bits + slot, raw, mask=gt)
                tl.store(out_idx + slot, idx, mask=gt)
            eq = hit & (key == threshold)
            n_eq = tl.sum(eq.to(tl.int32), axis=0)
            if n_eq > 0:
                slot = tl.atomic_add(counters + 1, n_eq, sem="relaxed") + tl.cumsum(eq.to(tl.int32), axis=0) - 1
                take = eq & (slot < ties)
                tl.store(out_bits + above + slot, raw, mask=take)
                tl.store(out_idx + above + slot, idx, mask=take)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def chunk_size(rows: int, vocab: int, device: torch.device, block: int = BLOCK) -> int:
    """Elements a program reads (a power-of-two multiple of ``block``): about `PROGRAMS_PER_SM` programs per SM over
    all rows, at most `MAX_CHUNK`; on the CPU (interpreter) chunks of at most 4 tiles."""
    if device.type != "cuda":
        return block * min(4, triton.cdiv(vocab, block))
    sms = _sms(device.index if device.index is not None else torch.cuda.current_device())
    want = triton.cdiv(rows * vocab, sms * PROGRAMS_PER_SM)
    return max(block, min(max(MAX_CHUNK, block), triton.next_power_of_2(want)))


def select_top(logits: torch.Tensor, count: int, *, block: int = BLOCK, chunk: int | None = None,
               num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, min(count, V), dim=1)``'s values (the logits' dtype) and indices (int32), sorted from the
    largest, of ``logits [R, V]`` (float32 / bf16 / fp16, unit stride along V); module docstring. ``block`` and
    ``chunk`` (powers of two, ``chunk`` a multiple of ``block``): a tile and a program's part of a row."""
    rows, vocab = logits.shape
    count = min(count, vocab)
    raw_dtype, key_bits, inf_bits = _RAW[logits.dtype]
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    passes = key_bits // 8
    scratch_width = passes * BINS + 2
    scratch = torch.zeros(rows, scratch_width, dtype=torch.int32, device=logits.device)
    out_bits = torch.empty(rows, count, dtype=raw_dtype, device=logits.device)
    out_idx = torch.empty(rows, count, dtype=torch.int32, device=logits.device)
    if rows and count:
        chunk = chunk or chunk_size(rows, vocab, logits.device, block)
        if chunk % block:
            raise ValueError(f"chunk {chunk} is no multiple of block {block}")
        bits = logits.view(raw_dtype)
        grid = (rows, triton.cdiv(vocab, chunk))
        common = dict(KEY_BITS=key_bits, INF_BITS=inf_bits, SCRATCH=scratch_width, BLOCK=block, BINS=BINS,
                      num_warps=num_warps)
        for p in range(passes):
            _hist_kernel[grid](bits, bits.stride(0), vocab, count, chunk, scratch, PASS=p, **common)
        _gather_kernel[grid](bits, bits.stride(0), vocab, count, chunk, scratch, out_bits, out_idx, PASSES=passes,
                             **common)
    values, order = torch.sort(out_bits.view(logits.dtype), dim=1, descending=True)
    return values, out_idx.gather(1, order)
