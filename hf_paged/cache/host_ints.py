"""Python int lists as CPU tensors, built through `array` buffers (a step's slots, positions, ids, block tables).

Why: `torch.tensor(list)` converts element by element, ~2 ms for the 16k slots of one long prefill step, and a
prefill step is built while the GPU waits (the step before ended in its tokens' sync). An `array` of the same ints is
filled in C and read without a copy by `torch.frombuffer`: ~0.3 ms. Values that do not fit the dtype raise
`OverflowError`, as `torch.tensor` does.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

__all__ = ["int_table", "int_tensor"]

_CODES = {torch.int32: "i", torch.int64: "q"}
assert array("i").itemsize == 4 and array("q").itemsize == 8


def _tensor(buffer: array, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    out = torch.frombuffer(buffer, dtype=dtype) if len(buffer) else torch.empty(0, dtype=dtype)
    return out.pin_memory() if pin else out  # (frombuffer keeps `buffer` alive as long as the tensor)


def int_tensor(values: Sequence[int], dtype: torch.dtype = torch.int32, *, pin: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor of `values` (int32 or int64), in pinned memory when `pin` (for a non-blocking upload)."""
    return _tensor(array(_CODES[dtype], values), dtype, pin)


def int_table(rows: Sequence[Sequence[int]], width: int, dtype: torch.dtype = torch.int32, *,
              pin: bool = False) -> torch.Tensor:
    """A `[len(rows), width]` CPU tensor of `rows`, each padded with zeros to `width` (at least its length)."""
    buffer = array(_CODES[dtype])
    zeros = array(_CODES[dtype], bytes(buffer.itemsize * width))
    for row in rows:
        if len(row) > width:
            raise ValueError(f"a row of {len(row)} ints does not fit width {width}")
        buffer.extend(row)
        buffer.extend(zeros[: width - len(row)])
    return _tensor(buffer, dtype, pin).view(len(rows), width)
