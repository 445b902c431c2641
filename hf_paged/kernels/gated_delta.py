"""The gated delta rule (gated DeltaNet layers of Qwen3.5 and Qwen3-Next) on states kept in slots: dispatch and the
torch reference.

`gdn_decode` runs one token of each row: the row's state `state[slots[b]]` (`[heads, K, V]`, float32) decays by
`exp(g)`, takes the delta-rule update `k (v - S^T k) * beta`, gives the output `S^T q`, and is written back in place.
That is exactly transformers' `torch_recurrent_gated_delta_rule` for one token (queries and keys L2-normalised with
eps 1e-6 when `use_l2norm`, queries scaled by `scale`). Triton on CUDA (`triton_gated_delta`), the reference
elsewhere.
"""

from __future__ import annotations

import torch

from . import _triton_module, get_backend
from .checks import _FLOAT_DTYPES, _INT_DTYPES, _check_tensor

__all__ = ["gdn_decode", "gdn_decode_reference"]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gdn_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, slots: torch.Tensor, scale: float,
                         use_l2norm: bool = True) -> torch.Tensor:
    """`gdn_decode` in torch (the same operations, in the same order, as transformers' recurrent reference)."""
    q, k, v = q.float(), k.float(), v.float()
    if use_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    s = state.index_select(0, slots).float() * g.float().exp()[..., None, None]
    memory = (s * k[..., None]).sum(dim=-2)
    delta = (v - memory) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    out = (s * q[..., None]).sum(dim=-2)
    state.index_copy_(0, slots, s.to(state.dtype))
    return out.to(v.dtype) if v.dtype != torch.float32 else out


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, scale: float, use_l2norm: bool = True) -> torch.Tensor:
    """One decode token per row `b` of `q`/`k` `[B, H, K]`, `v` `[B, H, V]`, `g`/`beta` `[B, H]` on the states
    `state[slots[b]]` of `state` `[slots, H, K, V]`, updated in place; returns `[B, H, V]` in `v`'s dtype. Rows sharing
    a slot (a CUDA graph's padding rows, on the scratch slot) leave it undefined."""
    for name, t, dims in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2), ("state", state, 4)):
        _check_tensor(name, t, dims, _FLOAT_DTYPES, q.device if isinstance(q, torch.Tensor) else None)
    _check_tensor("slots", slots, 1, _INT_DTYPES, q.device)
    if q.shape != k.shape or v.shape[:2] != q.shape[:2] or state.shape[1:] != (q.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"gdn_decode: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} state "
                         f"{tuple(state.shape)} do not fit")
    if get_backend(q.device) == "triton":
        return _triton_module("triton_gated_delta").gdn_decode(q, k, v, g, beta, state, slots, scale, use_l2norm)
    return gdn_decode_reference(q, k, v, g, beta, state, slots, scale, use_l2norm)
