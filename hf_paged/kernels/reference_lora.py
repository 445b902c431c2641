"""Plain-torch multi-LoRA delta: the CPU path of :mod:`hf_paged.kernels.lora` and the oracle of its Triton kernel.

Semantics (the kernel contract; :mod:`hf_paged.kernels.lora` has the shapes): token ``t`` with adapter slot
``s = index[t]`` gets ``(x_t @ a[s].T) @ b[s].T``, zero when ``s`` is outside ``[0, L)`` (-1: no adapter). The scale
``alpha / r`` is folded into ``b`` when an adapter is loaded into its slot, and ranks below the pool's are zero
padded, so neither appears here.

Why one dense form and no gather: every slot's shrink is one GEMM over the stacked ``[L * R, in]`` rows, the slots a
token does not use are masked to zero, and the expand is one more GEMM over ``[L * R, out]``. No host sync (a loop
over the slots in use would need their list on the host), so it records into CUDA graphs and traces under
`torch.compile` with a symbolic token count; its cost is ``L`` times the selected adapters' low-rank work, small
beside the base projection while ``L * R`` is small beside ``out``. Sums run in the input dtype (float32 in the
tests, where it matches PEFT's merged model up to the order of the sums).
"""

from __future__ import annotations

import torch

__all__ = ["lora_delta", "naive_lora_delta"]


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[T, out]``: each token's adapter delta (see the module docstring)."""
    slots, rank, width = a.shape
    tokens = x.shape[0]
    shrunk = x @ a.reshape(slots * rank, width).to(x.dtype).T  # [T, L * R]
    mask = index.view(tokens, 1) == torch.arange(slots, device=x.device, dtype=index.dtype)  # [T, L]
    shrunk = (shrunk.view(tokens, slots, rank) * mask.unsqueeze(-1).to(shrunk.dtype)).view(tokens, slots * rank)
    expand = b.to(x.dtype).permute(0, 2, 1).reshape(slots * rank, b.shape[1])  # [L * R, out]
    return shrunk @ expand


def naive_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Token by token, in float64 (the tests' oracle for both paths)."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64, device=x.device)
    for t, s in enumerate(index.tolist()):
        if 0 <= s < a.shape[0]:
            out[t] = (x[t].double() @ a[s].double().T) @ b[s].double().T
    return out
