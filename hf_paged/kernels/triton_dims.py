"""Head dims that are no power of two (80, 96, 192, ...) in the Triton kernels.

`tl.arange` and `tl.dot` take powers of two, so every kernel computes a head dim `d` in a tile `padded_dim(d)` wide
and masks the lanes past `d` in its loads and stores: those lanes load as zeros, add nothing to `q . k` or to
`p @ v`, and are never written. For a power-of-two head dim the tile is the head dim and `_dim_mask` adds no
term, so the key loops and output stores compile as before (only the decode kernel's one-off write of the step's
own K/V carries a lane mask either way; the decode kernel's H100 timings at power-of-two head dims are unchanged,
`benchmarks/results/h100_2026-11-27b/`). Imported lazily with the kernels (needs triton).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_dim_mask", "padded_dim"]


def padded_dim(d: int) -> int:
    """The tile width a head dim `d` is computed in: the next power of two, at least 16 (`tl.arange` and `tl.dot`
    need powers of two; a head dim of 80, 96 or 192 is loaded into a wider tile, masked)."""
    return max(16, triton.next_power_of_2(d))


@triton.jit
def _dim_mask(mask, offs, DIM: tl.constexpr, PAD: tl.constexpr):
    """`mask & (offs < DIM)`: the lanes of a head dim padded to the power of two `PAD` that exist. A power-of-two
    head dim (`PAD == DIM`) gets `mask` unchanged, so its kernels compile as they would without padding."""
    if PAD != DIM:
        mask = mask & (offs < DIM)
    return mask
