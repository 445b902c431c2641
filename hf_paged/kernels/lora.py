"""Multi-LoRA dispatcher: `lora_delta`, every token of a step through its own adapter (or none) in one call.

Contract (every tensor on one device; nothing here reads tensor values, so the call is safe under CUDA-graph capture
and traces under `torch.compile`):

* ``x [T, in]`` (float32 / float16 / bfloat16), the input of one linear for the step's ``T`` tokens;
* ``a [L, R, in]`` and ``b [L, out, R]``: the adapter pool of that linear, ``L`` slots of rank ``R`` (each adapter's
  ``lora_A`` / ``lora_B`` zero padded to ``R``, the scale folded into ``b``);
* ``index [T]`` (int32 / int64): each token's slot, -1 (or anything outside ``[0, L)``) for none.

Returns ``[T, out]`` in ``x``'s dtype: ``(x_t @ a[s].T) @ b[s].T``, zero for tokens without an adapter; the caller
adds it to the base projection. Backend: the Triton kernels of :mod:`hf_paged.kernels.triton_lora` on CUDA tensors
when triton imports, the torch reference (:mod:`hf_paged.kernels.reference_lora`) otherwise; ``HF_PAGED_BACKEND``
overrides as for the other kernels (``triton`` on the CPU needs ``TRITON_INTERPRET=1``), and `BACKEND` overrides it
for this op alone. Why the torch form stays a choice on a GPU too: it reads every slot's adapter once per call
instead of each token's once per token, which can win for long prefill steps while ``L * R`` stays small
(`benchmarks/bench_lora.py --lora-kernel` measures both).
"""

from __future__ import annotations

import torch

from . import _check_tensor, _check_triton_device, _triton_module, get_backend, reference_lora

__all__ = ["BACKEND", "lora_delta"]

#: "triton" or "torch" for this op whatever `get_backend` says; None: follow it (set before CUDA graphs are recorded)
BACKEND: str | None = None

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[T, out]``: each token's LoRA delta (see the module docstring)."""
    _check_tensor("x", x, 2, _FLOATS)
    _check_tensor("a", a, 3, _FLOATS, x.device)
    _check_tensor("b", b, 3, _FLOATS, x.device)
    _check_tensor("index", index, 1, _INTS, x.device)
    if a.shape[2] != x.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} must read the input width {x.shape[1]} (its last dim)")
    if b.shape[0] != a.shape[0] or b.shape[2] != a.shape[1]:
        raise ValueError(f"b must have shape ({a.shape[0]}, out, {a.shape[1]}) (slots, out, rank), got {tuple(b.shape)}")
    if index.shape[0] != x.shape[0]:
        raise ValueError(f"index must have one entry per token ({x.shape[0]}), got {index.shape[0]}")
    if x.shape[0] == 0 or a.shape[0] == 0:
        return x.new_zeros(x.shape[0], b.shape[1])
    if (BACKEND or get_backend(x.device)) == "triton":
        _check_triton_device(x)
        return _triton_module("triton_lora").lora_delta(x if x.stride(-1) == 1 else x.contiguous(), a, b, index)
    return reference_lora.lora_delta(x, a, b, index)
