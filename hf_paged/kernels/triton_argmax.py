"""Argmax of every row of a `[R, V]` logits tensor in Triton: the greedy pick, spread over the whole GPU.

Why: `torch.argmax(dim=-1)` over a decode step's logits runs one reduction per row; with a few dozen rows and a
128k vocabulary it leaves most SMs idle: 27 us on an H100 for 1 to 64 float32 rows of 128,256 (a llama-1b decode step
is about 1.5 ms), where this kernel takes 5-13 us (`benchmarks/bench_sampling.py --greedy-only`). Each row is cut
into chunks so that the grid has a few programs per SM whatever the batch: each program writes its chunk's best
(value, index), and the last of a row's programs to finish picks the row's best among them, in the same launch.
With more rows than SMs torch's reduction is as fast, and it is what runs: a Triton launch costs the host about
35 us, torch's 8 (the engine's picks overlap the GPU, but host time per step is a budget too).

Same answer as `torch.argmax(dim=-1)`, bit for bit: the first index of the row's maximum; a row with a NaN gives its
first NaN (torch orders NaN above every number); a row of -inf gives 0. Values are compared in float32 (a cast of a
half-precision value is exact, so the order is the row's own).

Imported lazily by :mod:`hf_paged.kernels.sampling` (needs triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import _device_sms

BLOCK = 1024  # elements of a row one program loads per loop step
PROGRAMS_PER_SM = 4  # the grid aims at this many programs per SM
MAX_CHUNKS = 1024  # chunks of a row at most (a power of two: the row's last program loads them all at once)
_NONE = 2**31 - 1  # "no index yet"


@triton.jit
def _best_of(values, indices, nan_first, NONE: tl.constexpr):
    """(value, index) of the first maximum among `values` (float32) at `indices`, or (NaN, first NaN's index)."""
    top = tl.max(values, axis=0)
    first = tl.min(tl.where(values == top, indices, NONE), axis=0)
    has_nan = nan_first < NONE
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_first, first)


# One compiled variant per logits dtype and row stride: the chunk length and count change with the number of rows, and
# a variant compiled mid-run costs a step a few hundred ms (the picker's warm-up compiles the one it needs).
@triton.jit(do_not_specialize=["chunk", "num_chunks"])
def _argmax_kernel(X, stride_x, vocab, chunk, PV, PI, CNT, OUT, num_chunks, BLOCK: tl.constexpr,
                   MAX_C: tl.constexpr, NONE: tl.constexpr):
    """Best (value, index) of chunk `program_id(1)` of row `program_id(0)`, into `PV`/`PI [R, num_chunks]`; the row's
    last chunk to finish picks the row's best among them into `OUT` (one launch: its host cost is the pick's)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    base = X + row.to(tl.int64) * stride_x
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.full([BLOCK], NONE, tl.int32)
    nans = tl.full([BLOCK], NONE, tl.int32)
    for off in range(start, end, BLOCK):
        idx = off + lanes
        inside = idx < end
        x = tl.load(base + idx, mask=inside, other=float("-inf")).to(tl.float32)
        nans = tl.minimum(nans, tl.where(inside & (x != x), idx, NONE))
        # a lane's first element always counts (a row of -inf must still name an index); later ones only if larger,
        # so equal values keep the lane's earliest index
        take = inside & ((x > best) | (where == NONE))
        best = tl.where(take, x, best)
        where = tl.where(take, idx, where)
    value, index = _best_of(best, where, tl.min(nans, axis=0), NONE)
    if num_chunks == 1:
        tl.store(OUT + row, index.to(tl.int64))
    else:
        tl.store(PV + row * num_chunks + part, value)
        tl.store(PI + row * num_chunks + part, index)
        # the chunks' indices are the row's, so among equal values the smallest index is the first. Every thread's
        # stores are done (barrier) before the counter is bumped (release); the last chunk reads them after its
        # acquire, past L1 (`.cg`), and leaves the counter at zero for the next launch
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + row, 1, sem="acq_rel")
        if ticket == num_chunks - 1:
            c = tl.arange(0, MAX_C)
            mine = c < num_chunks
            values = tl.load(PV + row * num_chunks + c, mask=mine, other=float("-inf"), cache_modifier=".cg")
            indices = tl.load(PI + row * num_chunks + c, mask=mine, other=NONE, cache_modifier=".cg")
            nan_first = tl.min(tl.where(mine & (values != values), indices, NONE), axis=0)
            _, index = _best_of(tl.where(mine, values, float("-inf")), indices, nan_first, NONE)
            tl.store(OUT + row, index.to(tl.int64))
            tl.atomic_xchg(CNT + row, 0)


def chunks_of(rows: int, vocab: int, sms: int) -> tuple[int, int]:
    """(chunk length, number of chunks) of a row: about `PROGRAMS_PER_SM` programs per SM over all rows, chunks of
    whole `BLOCK`s, none empty. Python ints only: no device sync, safe in a CUDA-graph capture."""
    want = max(1, min(MAX_CHUNKS, triton.cdiv(PROGRAMS_PER_SM * sms, max(rows, 1)), triton.cdiv(vocab, BLOCK)))
    chunk = triton.cdiv(triton.cdiv(vocab, want), BLOCK) * BLOCK
    return chunk, triton.cdiv(vocab, chunk)


class GreedyPick:
    """`argmax_rows` for one device, with its scratch kept between calls (an engine's picker holds one, and calls it
    every greedy step: the device's SM count, the buffers of the chunks' partial bests and the rows' counters, zeros
    between launches, are looked up once). Calls must run one after another on one stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sms = _device_sms(device)
        self.values = self.indices = self.counters = None

    def _take(self, rows: int, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Buffers for `rows` rows of `num_chunks` chunks: `rows * num_chunks` partials, `rows` counters (grown to
        at least twice their old size when too small)."""
        held = 0 if self.values is None else self.values.numel()
        if held < rows * num_chunks or self.counters.numel() < rows:
            size = max(rows * num_chunks, 2 * held)
            self.values = torch.empty(size, dtype=torch.float32, device=self.device)
            self.indices = torch.empty(size, dtype=torch.int32, device=self.device)
            self.counters = torch.zeros(max(rows, 2 * (0 if self.counters is None else self.counters.numel())),
                                        dtype=torch.int32, device=self.device)
        return self.values, self.indices, self.counters

    def warm_up(self, vocab: int, dtype: torch.dtype) -> None:
        """Launch both paths once for `[*, vocab]` logits of `dtype`: this kernel (up to one row per SM) and torch's
        argmax (past that). Compiling is not enough: CUDA loads a kernel's code at its first launch (torch's argmax
        cost the first greedy step of 256 rows about 6 ms on an H100 otherwise)."""
        for rows in (1, self.sms + 1):
            self(torch.zeros((rows, vocab), dtype=dtype, device=self.device))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(dim=-1)` of a `[R, V]` float tensor on this device, as int64 `[R]`."""
        rows, vocab = logits.shape
        if rows > self.sms:  # torch's one block per row fills the GPU already (as fast on an H100), for less host time
            return logits.argmax(dim=-1)
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if rows == 0:
            return out
        chunk, num_chunks = chunks_of(rows, vocab, self.sms)
        values, indices, counters = self._take(rows, num_chunks)
        _argmax_kernel[(rows, num_chunks)](logits, logits.stride(0), vocab, chunk, values, indices, counters, out,
                                           num_chunks, BLOCK=BLOCK, MAX_C=MAX_CHUNKS, NONE=_NONE, num_warps=4)
        return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of a `[R, V]` float tensor, as int64 `[R]` on its device (scratch allocated for this
    call; see `GreedyPick`)."""
    return GreedyPick(logits.device)(logits)
