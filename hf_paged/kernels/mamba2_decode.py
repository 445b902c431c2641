"""One decode token of Mamba 2 (the mixers of Granite 4 hybrid, Bamba, Falcon-H1, Nemotron-H) on states kept in
slots: dispatch and the torch reference.

`mamba2_decode` runs transformers' `mamba2_selective_state_update` (its torch form, transformers 5.17) for one token
of each row on the row's state `state[slots[b]]` (`[heads, head_dim, state_size]`, float32), written back in place:
`dt = softplus(dt + dt_bias)` (no clamp: transformers clamps only in its chunk scan), `dA = exp(dt * A)`,
`state = state * dA + (dt * B) x^T`, `y = state . C + D * x`, B and C per group repeated to the heads. In a 16-bit
model it rounds where transformers' torch code does (`dt`, `dt * B`, `dt * B * x`, the state before its product
with C, that product and the skip `x * D` in the model's dtype; the state and its decay in float32), so the fast
path's tokens follow the mixer's own decode.

Why a kernel: gathering the states (`index_select`), updating the copy in torch (`dA`, `dt * B * x`, the products
and sums each a state-sized tensor) and scattering it back (`index_copy_`) read or wrote some twenty state-sized
tensors, the largest of a decode step (a Granite-4.0-H-Tiny shape: 400 MB a layer at 256 rows); Triton's kernel
(`triton_mamba2_decode`, on CUDA) reads each state once and writes it once.
The reference (elsewhere) gathers and scatters, as transformers' decode does.

Each row has a slot of its own; rows that share one (a CUDA graph bucket's padding rows, all on the pool's scratch
slot, as for `gated_delta.gdn_decode`) leave that slot's state and their outputs undefined, and never touch another.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _triton_module, get_backend
from .checks import _FLOAT_DTYPES, _INT_DTYPES, _check_tensor

__all__ = ["mamba2_decode", "mamba2_decode_reference"]


def mamba2_decode_reference(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                            d: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                            slots: torch.Tensor) -> torch.Tensor:
    """`mamba2_decode` in torch: transformers' `mamba2_selective_state_update`'s operations in its order, dtypes and
    shapes (a head's `dt`, `dt_bias`, `A`, `D` expanded over `head_dim` and `state_size` as its decode form passes
    them: torch's vectorised `exp` and `softplus` round the last bit by position), on the states gathered from
    `slots` and written back."""
    rows, heads, dim = x.shape
    groups, size = b.shape[1:]
    repeat = heads // groups
    s = state.index_select(0, slots)
    step = F.softplus(dt[:, :, None].expand(-1, -1, dim) + dt_bias[:, None].expand(-1, dim).to(dt.dtype))[..., None]
    decay = torch.exp(step.float() * a[:, None, None].expand(-1, dim, size).float())
    bh = b.reshape(rows, groups, 1, size).expand(rows, groups, repeat, size).contiguous()
    dbx = (step * bh.reshape(rows, heads, 1, size)) * x[..., None]
    new = s * decay + dbx
    state.index_copy_(0, slots, new.to(state.dtype))
    ch = c.reshape(rows, groups, 1, size).expand(rows, groups, repeat, size).contiguous()
    out = torch.bmm(new.to(c.dtype).view(rows * heads, dim, size), ch.view(rows * heads, size, 1))
    out = out.view(rows, heads, dim)
    out = (out + x * d[:, None].expand(-1, dim)).to(out.dtype)
    return out.to(x.dtype).contiguous()


def mamba2_decode(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                  d: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One decode token per row `r`: `x` `[B, heads, head_dim]`, `dt` `[B, heads]`, `b`/`c` `[B, groups, state_size]`
    (`x`, `dt`, `b`, `c` of one dtype), the head's `a` (= -exp(A_log)), `d`, `dt_bias` `[heads]`, on the state
    `state[slots[r]]` of `state` `[slots, heads, head_dim, state_size]`, updated in place. Returns `y`
    `[B, heads, head_dim]` in `x`'s dtype. One slot per row (module docstring)."""
    for name, t, dims in (("x", x, 3), ("dt", dt, 2), ("a", a, 1), ("b", b, 3), ("c", c, 3), ("d", d, 1),
                          ("dt_bias", dt_bias, 1), ("state", state, 4)):
        _check_tensor(name, t, dims, _FLOAT_DTYPES, x.device if isinstance(x, torch.Tensor) else None)
    _check_tensor("slots", slots, 1, _INT_DTYPES, x.device)
    for name, t in (("dt", dt), ("b", b), ("c", c)):
        if t.dtype != x.dtype:
            raise TypeError(f"mamba2_decode: {name} ({t.dtype}) must have x's dtype ({x.dtype})")
    rows, heads, dim = x.shape
    groups, size = b.shape[1:]
    if (dt.shape != (rows, heads) or b.shape[0] != rows or c.shape != b.shape or groups == 0 or heads % groups
            or any(t.shape != (heads,) for t in (a, d, dt_bias)) or slots.shape != (rows,)
            or state.shape[1:] != (heads, dim, size)):
        raise ValueError(f"mamba2_decode: shapes x {tuple(x.shape)} dt {tuple(dt.shape)} a {tuple(a.shape)} b "
                         f"{tuple(b.shape)} c {tuple(c.shape)} d {tuple(d.shape)} dt_bias {tuple(dt_bias.shape)} "
                         f"state {tuple(state.shape)} slots {tuple(slots.shape)} do not fit")
    if get_backend(x.device) == "triton":
        return _triton_module("triton_mamba2_decode").mamba2_decode(x, dt, a, b, c, d, dt_bias, state, slots)
    return mamba2_decode_reference(x, dt, a, b, c, d, dt_bias, state, slots)
