"""What the one-call fast paths of recurrent layers share (`gated_deltanet`, `mamba2`): a ragged step's sequences as
runs of packed rows, the depthwise causal convolution over them from each sequence's convolution state, and
flash-linear-attention's import.

A recurrent layer's generic adapter (`hf_paged.attention.recurrent`) calls the module's own forward once per prefill
chunk; a fast path runs every row of the step at once, so it must keep the sequences apart itself: each row's
convolution window holds its own sequence's rows and, before them, that sequence's state (zeros for a fresh one), and
each sequence's new state is the last `K` inputs of (its state, its rows). Both paths store a convolution state as
the last `K` inputs (`[C, K]`, what transformers' `update_conv_state` keeps), so one implementation serves both.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["Sequences", "enabled", "fla_function", "ragged_conv", "run_packed", "varlen_conv"]

#: False: every recurrent layer runs the generic adapter, one call per prefill chunk, even where a fast path is
#: installed (`benchmarks/bench_generate.py`'s `*_generic` systems compare the two in one process). Read per call.
FAST_PATHS = True


def enabled(hidden: torch.Tensor, force: bool) -> bool:
    """Whether a fast path runs for a step on `hidden`'s device: on CUDA (or the CPU when `force`), unless
    `FAST_PATHS` is off."""
    return FAST_PATHS and (hidden.is_cuda or force)


class Sequences:
    """The sequences of a ragged step: `rows` = (first row, tokens, continues a state) per sequence, in slot order."""

    def __init__(self, rows: list[tuple[int, int, bool]], device: torch.device) -> None:
        self.n = len(rows)
        self.firsts = np.array([r[0] for r in rows], dtype=np.int64)
        self.lens = np.array([r[1] for r in rows], dtype=np.int64)
        self.resumes = np.array([bool(r[2]) for r in rows])
        self.members = np.concatenate([np.arange(f, f + m) for f, m in zip(self.firsts, self.lens)])
        self.device = device
        self.prev = torch.as_tensor(self.resumes, device=device)
        # the rows decoding one token from a state; the others are prefill chunks (fresh, or resumed from a state)
        self.decoding = (self.lens == 1) & self.resumes

    def rows_of(self, which: np.ndarray) -> np.ndarray:
        """The rows of the sequences `which` (indices), in order."""
        if len(which) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(self.firsts[i], self.firsts[i] + self.lens[i]) for i in which])

    def cu_seqlens(self, which: np.ndarray) -> torch.Tensor:
        """`[len(which) + 1]` int64 on the CPU: the bounds of the sequences `which` once their rows are packed."""
        return torch.from_numpy(np.concatenate([[0], np.cumsum(self.lens[which])]).astype(np.int64))


def run_packed(fn: Callable[[torch.Tensor, list[tuple[int, int, bool]]], torch.Tensor], hidden: torch.Tensor,
               rows: list[tuple[int, int, bool]]) -> torch.Tensor | None:
    """`fn(packed hidden, packed rows)` scattered back to `hidden`'s rows, zeros for rows of no sequence (a CUDA
    step's token grid pads the step), when the sequences' rows are not exactly `0 .. T-1` in order; None when they
    are (then the caller runs on `hidden` itself)."""
    lens = np.array([r[1] for r in rows], dtype=np.int64)
    members = np.concatenate([np.arange(r[0], r[0] + r[1]) for r in rows])
    if len(members) == hidden.shape[0] and (members == np.arange(len(members))).all():
        return None
    packed = np.concatenate([[0], np.cumsum(lens)[:-1]])
    take = torch.as_tensor(members, device=hidden.device)
    out = fn(hidden.index_select(0, take), [(int(f), r[1], r[2]) for f, r in zip(packed, rows)])
    return out.new_zeros(hidden.shape[0], *out.shape[1:]).index_copy_(0, take, out)


def varlen_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, history: torch.Tensor,
                index: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution of packed rows: `out[r] = sum_t weight[:, t] * window[r, t] + bias`.

    `x` `[T, C]`, `weight` `[C, K]`, `history` `[R, C]` (the rows before the sequences' first rows: their states'
    last `K - 1` entries, zeros for a fresh sequence), `index` `[T, K]` int64 into `cat([history, x])` (each row's
    window: its sequence's own rows and history only). Accumulates in float32."""
    buffer = torch.cat([history.to(x.dtype), x])
    out = None
    for tap in range(weight.shape[1]):
        term = buffer.index_select(0, index[:, tap]).float() * weight[:, tap].float()
        out = term if out is None else out + term
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def ragged_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_pool: torch.Tensor,
                state_slots: torch.Tensor, seqs: Sequences) -> torch.Tensor:
    """The depthwise causal convolution (`weight` `[C, K]`, no activation) of the packed rows `x` `[T, C]` of the
    sequences `seqs`, each from its convolution state in `conv_pool` `[slots, C, K]` at `state_slots` (zeros for a
    fresh one); writes each sequence's new state (the last `K` inputs of its state and rows) there. Returns `[T, C]`."""
    device = x.device
    kernel = weight.shape[1]
    n, firsts, lens, members = seqs.n, seqs.firsts, seqs.lens, seqs.members
    seq_of = np.repeat(np.arange(n), lens)
    offset = members - np.repeat(firsts, lens)  # position of each row in its sequence's chunk
    states = conv_pool.index_select(0, state_slots) * seqs.prev[:, None, None]  # [n, C, K]: zeros for fresh ones
    history = states[:, :, 1:].transpose(1, 2).reshape(n * (kernel - 1), -1)  # [n * (K - 1), C]
    taps = np.arange(kernel) - (kernel - 1)  # window positions relative to the row
    position = offset[:, None] + taps[None, :]
    index = np.where(position >= 0, n * (kernel - 1) + members[:, None] + taps[None, :],
                     seq_of[:, None] * (kernel - 1) + (kernel - 1) + position)
    conv = varlen_conv(x, weight, bias, history, torch.as_tensor(index, device=device))
    # each sequence's new convolution state: the last K inputs of (its state, its rows)
    full = torch.cat([states.transpose(1, 2).reshape(n * kernel, -1).to(x.dtype), x])
    ends = offset + 1 == np.repeat(lens, lens)
    last = members[ends]  # each sequence's last row
    position = lens[:, None] - kernel + np.arange(kernel)[None, :]
    index = np.where(position >= 0, n * kernel + (last[:, None] - (lens[:, None] - 1)) + position,
                     np.arange(n)[:, None] * kernel + kernel + position)
    new_conv = full.index_select(0, torch.as_tensor(index.reshape(-1), device=device)).reshape(n, kernel, -1)
    conv_pool.index_copy_(0, state_slots, new_conv.transpose(1, 2).to(conv_pool.dtype))
    return conv


def fla_function(module: str, name: str, fallback: str) -> Callable | None:
    """flash-linear-attention's `module.name` when fla is installed, else None (the caller's torch `fallback` runs).

    fla-core installed but failing to import (e.g. its dependency einops missing) would make that fallback silent, so a
    failed import is said, with its reason and what runs instead, not swallowed (callers cache the answer: once)."""
    if importlib.util.find_spec("fla") is None:  # not installed: the reference runs, as documented
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as error:  # noqa: BLE001 - any failure of its import: the reference runs, said once
        warnings.warn(f"flash-linear-attention is installed but cannot be imported ({error}): {fallback}",
                      stacklevel=3)
        return None
