"""Gradients stop at the paged cache: `cut_gradients` (why: its docstring)."""

from __future__ import annotations

import warnings

import torch

__all__ = ["GRAD_WARNED", "cut_gradients"]

GRAD_WARNED = [False]  # the grad-mode warning is given once a process


def cut_gradients(key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients stop at the paged cache: the K/V it stores are constants for autograd.

    Why: the pool is one persistent tensor written in place by every forward, and the paged attention kernels (Triton)
    have no backward; letting autograd record the writes would keep every step's graph alive through the pool and
    could not differentiate the reads anyway. The attention function treats its output as a constant too (see
    `hf_paged.attention.functions`), so a forward in grad mode gives the same logits as `DynamicCache` and backward
    runs, but no gradient reaches the query/key/value projections through attention. Train with `DynamicCache` (or
    `use_cache=False`) when those gradients are needed; the paged cache is for generation.
    """
    if not GRAD_WARNED[0]:
        GRAD_WARNED[0] = True
        warnings.warn(
            "hf_paged.PagedCache in grad mode: gradients do not flow through the attention over the paged cache "
            "(its K/V and attention output are constants for autograd); use DynamicCache or use_cache=False to "
            "train through attention", stacklevel=3,
        )
    return key_states.detach(), value_states.detach()
