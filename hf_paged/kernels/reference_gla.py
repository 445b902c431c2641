"""A scalar-gated linear recurrence over packed sequences, the torch reference of flash-linear-attention's
variable-length `chunk_simple_gla` (what Mamba 2's SSD scan maps to: `hf_paged.attention.mamba2`).

Per head, a state `S` `[K, V]` starts at the sequence's initial state and, token by token, decays by `exp(g_t)` and
takes `k_t^T v_t`; the token's output is `scale * q_t S_t` (the state after the token):

    S_t = exp(g_t) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t

Computed chunk by chunk (64 tokens, as fla does): within a chunk, the decays' cumulative sums `b` give the causal
weights `exp(b_i - b_j)` of the chunk's own tokens and `exp(b_i)` of the state it started from. Every sequence of
`cu_seqlens` is scanned apart, from its own initial state; arithmetic in float32.

The same contract as fla's call with ``cu_seqlens`` (batch 1, inputs ``[1, T, H, ...]``, ``initial_state``
``[N, H, K, V]``, the final states float32, the output in `v`'s dtype), so the CPU and a GPU without fla run what the
GPU's fla call runs, and `tests/test_mamba2_fast.py` compares it with transformers' own `mamba2_chunk_scan`.
"""

from __future__ import annotations

import torch

from .checks import _FLOAT_DTYPES, _INT_DTYPES, _check_tensor

__all__ = ["chunk_simple_gla_reference"]


def chunk_simple_gla_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               cu_seqlens: torch.Tensor, initial_state: torch.Tensor, scale: float = 1.0,
                               chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """`q`, `k` `[1, T, H, K]`, `v` `[1, T, H, V]`, `g` `[1, T, H]` (log decays), `cu_seqlens` `[N + 1]` (int, from 0
    to T), `initial_state` `[N, H, K, V]`: returns (`o` `[1, T, H, V]` in `v`'s dtype, the final states `[N, H, K, V]`
    float32). Module docstring."""
    for name, t, dims in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("initial_state", initial_state, 4)):
        _check_tensor(name, t, dims, _FLOAT_DTYPES, q.device)
    _check_tensor("cu_seqlens", cu_seqlens, 1, _INT_DTYPES)
    tokens, heads, dk = q.shape[1:]
    if (q.shape[0] != 1 or k.shape != q.shape or v.shape[:3] != q.shape[:3] or g.shape != q.shape[:3]
            or initial_state.shape != (len(cu_seqlens) - 1, heads, dk, v.shape[3])):
        raise ValueError(f"chunk_simple_gla_reference: shapes q {tuple(q.shape)} k {tuple(k.shape)} v "
                         f"{tuple(v.shape)} g {tuple(g.shape)} initial_state {tuple(initial_state.shape)} (for "
                         f"{len(cu_seqlens) - 1} sequences) do not fit")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != tokens or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the {tokens} tokens, got {bounds}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    dtype = v.dtype
    q, k, v, g = (t[0].float().transpose(0, 1) for t in (q, k, v, g))  # [H, T, ...]
    out = torch.empty_like(v)
    finals = []
    for i in range(len(bounds) - 1):
        state = initial_state[i].float()  # [H, K, V]
        for start in range(bounds[i], bounds[i + 1], chunk_size):
            stop = min(start + chunk_size, bounds[i + 1])
            qc, kc, vc = q[:, start:stop] * scale, k[:, start:stop], v[:, start:stop]
            b = g[:, start:stop].cumsum(-1)  # [H, c]
            causal = torch.ones(stop - start, stop - start, dtype=torch.bool, device=q.device).tril()
            weights = (b[:, :, None] - b[:, None, :]).masked_fill(~causal, float("-inf")).exp()
            out[:, start:stop] = (qc @ kc.transpose(-1, -2) * weights) @ vc + (qc * b.exp()[..., None]) @ state
            decayed = (kc * (b[:, -1:] - b).exp()[..., None]).transpose(-1, -2)  # each key to the chunk's end
            state = state * b[:, -1].exp()[:, None, None] + decayed @ vc
        finals.append(state)
    final = torch.stack(finals) if finals else initial_state.float()
    return out.transpose(0, 1)[None].to(dtype), final
