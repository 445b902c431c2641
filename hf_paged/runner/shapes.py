"""The shapes a step's GEMMs run at: a ragged step's token count, a decode step's batch bucket, the output
projection's row count.

Why a grid of shapes: cuBLAS pays for a GEMM shape the first time it meets it. Its kernel choice is a heuristic query
cached per shape (200-300 us of host time at a new shape against ~16 us, H100, `benchmarks/results/h100_2026-11-26i/`,
call k), and an output projection at a row count the process had not run held the host until the GPU drained (38 ms
of a 61 ms llama-1b prefill step, `benchmarks/results/h100_2026-11-27h/`, call 7). Steps padded to a grid meet few
shapes. Only ragged steps on CUDA are padded (`padded_tokens`, and `padded_rows` for the output projection of an
eager ragged step); decode-only eager steps, and every step off CUDA, run at their own sizes.
"""

from __future__ import annotations

__all__ = ["decode_buckets", "padded_rows", "padded_tokens"]


def padded_tokens(tokens: int, limit: int | None = None) -> int:
    """The token count a ragged (prefill or mixed) step runs at: `tokens` rounded up to a multiple of 16 up to 256,
    of 64 above, never past `limit` (the step's token budget) unless `tokens` already is.

    A ragged step's count is new almost every time; on the grid the counts repeat: lone llama-1b prompts of lengths
    not seen before prefilled in 21.8 against 25.5 ms (H100, `benchmarks/results/h100_2026-11-26i/`, call l). The
    padding rows belong to no sequence: their K/V are not written (slot -1), their attention output is zero and no
    logits are kept for them.
    """
    grain = 16 if tokens <= 256 else 64
    padded = -(-tokens // grain) * grain
    return max(tokens, min(padded, limit)) if limit is not None else padded


def decode_buckets(max_batch: int) -> list[int]:
    """The batch sizes a decode step is padded to (one CUDA graph each): 1, 2, 4, 8, then every 16 up to 128, every 32
    above, and `max_batch`."""
    sizes = [1, 2, 4, 8]
    size = 16
    while size < max_batch:
        sizes.append(size)
        size += 16 if size < 128 else 32
    sizes.append(max_batch)
    return sorted(set(s for s in sizes if s <= max_batch))


def padded_rows(rows: list[int], buckets: list[int]) -> list[int]:
    """The rows a ragged step's output projection runs over: `rows` (the kept positions) with the last repeated up to
    the next of `buckets` (the decode buckets, whose row counts the decode graphs' captures ran); as they are past the
    largest bucket. The step keeps the first `len(rows)` rows of the result."""
    bucket = next((b for b in buckets if b >= len(rows)), len(rows))
    return rows + rows[-1:] * (bucket - len(rows))
