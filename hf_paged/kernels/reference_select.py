"""Plain-torch reference of the top-k selection in Triton (:mod:`hf_paged.kernels.triton_radix_select`): the same
keys, the same bound from group maxima, the same 8-bit radix passes and threshold, so a test can check the kernels
step by step and both against ``torch.topk``.

Why a reference beside ``torch.topk``: ``torch.topk`` leaves two things open (which of the values tied at the
``count``-th it returns, and their order); this reference fixes both (the least indices among the tied, equal keys
by index), as the kernels do for every row whose list did not overflow, so it is one defined answer the tests
compare the kernels' and torch's against.
"""

from __future__ import annotations

import torch

__all__ = ["order_keys", "key_bits", "group_bound", "list_sizes", "neg_inf_key", "radix_threshold", "select_top",
           "BINS"]

BINS = 256
_RAW = {torch.float32: (torch.int32, 32), torch.bfloat16: (torch.int16, 16), torch.float16: (torch.int16, 16)}
_INF_BITS = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def key_bits(dtype: torch.dtype) -> int:
    """Bits of the key of a float type: its own width (bf16 and fp16 order on their 16 bits)."""
    return _RAW[dtype][1]


def order_keys(logits: torch.Tensor) -> torch.Tensor:
    """The kernel's signed order-preserving keys (int64) of float logits: the raw bits, a negative's magnitude bits
    flipped (-0.0 just below +0.0), every NaN the largest key (as torch.topk ranks NaN)."""
    raw_dtype, bits = _RAW[logits.dtype]
    b = logits.contiguous().view(raw_dtype).long()  # sign-extended
    mag = (1 << (bits - 1)) - 1
    key = torch.where(b < 0, b ^ mag, b)
    return torch.where((b & mag) > _INF_BITS[logits.dtype], torch.full_like(key, mag), key)


def group_bound(keys: torch.Tensor, count: int, group: int) -> torch.Tensor:
    """Per row of ``keys [R, V]``: the ``count``-th largest of the maxima of its groups of ``group`` consecutive keys
    (the last group shorter), a lower bound of its ``count``-th largest key (``count`` distinct keys reach it); the
    least int32 where the row has fewer groups than ``count``."""
    rows, vocab = keys.shape
    n_groups = -(-vocab // group)
    if n_groups < count:
        return torch.full((rows,), -(2**31), dtype=torch.long, device=keys.device)
    padded = torch.full((rows, n_groups * group), -(2**31), dtype=torch.long, device=keys.device)
    padded[:, :vocab] = keys
    return padded.view(rows, n_groups, group).amax(2).topk(count, dim=1).values[:, -1]


def neg_inf_key(dtype: torch.dtype) -> int:
    """The key of -inf in `dtype` (`order_keys`)."""
    return int(order_keys(torch.tensor([[-float("inf")]], dtype=dtype)).item())


def list_sizes(keys: torch.Tensor, count: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """How many keys of each row but -inf (of `dtype`) reach its `group_bound`: the length of its list (more than
    the kernel's ``cap``: the row overflows and takes the radix passes; fewer than ``count``: every key of the row
    but -inf, the least-index -inf ones completing it)."""
    floor = group_bound(keys, count, group).clamp(min=neg_inf_key(dtype) + 1)
    return (keys >= floor[:, None]).sum(1)


def radix_threshold(keys: torch.Tensor, count: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``keys [R, V]`` (``order_keys``, ``count <= V``): the ``count``-th largest key and how many keys
    equal to it are among the ``count`` largest (``[R]`` int64 each), found as the kernel finds them: ``bits / 8``
    passes, each a 256-bin histogram of the next digit (from the top) of the keys in the bucket found so far."""
    rows = keys.shape[0]
    u = keys + (1 << (bits - 1))  # the unsigned key, same order
    prefix = torch.zeros(rows, dtype=torch.long, device=keys.device)
    rem = torch.full((rows,), count, dtype=torch.long, device=keys.device)
    for p in range(bits // 8):
        shift = bits - 8 * (p + 1)
        match = (u >> (shift + 8)) == prefix[:, None]
        hist = torch.zeros(rows, BINS, dtype=torch.long, device=keys.device)
        hist.scatter_add_(1, (u >> shift) & (BINS - 1), match.long())
        at_least = hist.flip(1).cumsum(1).flip(1)  # keys in each bin or above
        d = (at_least >= rem[:, None]).sum(1) - 1  # the highest bin still reaching `rem` (at_least falls with the bin)
        rem = rem - torch.cat([at_least[:, 1:], torch.zeros_like(rem)[:, None]], 1).gather(1, d[:, None])[:, 0]
        prefix = prefix * BINS + d
    return prefix - (1 << (bits - 1)), rem


def select_top(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, min(count, V), dim=1)`` of ``logits [R, V]`` by the radix threshold: every key above it
    and the least-index ``ties`` of those equal to it, sorted by key from the largest (equal keys by index). Values in
    the logits' dtype, indices int64."""
    rows, vocab = logits.shape
    count = min(count, vocab)
    keys = order_keys(logits)
    threshold, ties = radix_threshold(keys, count, key_bits(logits.dtype))
    eq = keys == threshold[:, None]
    take = (keys > threshold[:, None]) | (eq & (eq.long().cumsum(1) <= ties[:, None]))
    index = take.nonzero()[:, 1].view(rows, count)
    order = keys.gather(1, index).sort(dim=1, descending=True, stable=True).indices
    index = index.gather(1, order)
    return logits.gather(1, index), index
