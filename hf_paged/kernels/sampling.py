"""`sample_tokens`: next token of every logits row on the device, greedy or sampled, with per-row parameters.

Backend: the Triton kernel (:mod:`hf_paged.kernels.triton_sampling`) on CUDA tensors when triton imports, the torch
reference (:mod:`hf_paged.kernels.reference_sampling`) otherwise; ``HF_PAGED_BACKEND`` overrides as for the other
kernels (``triton`` on CPU needs ``TRITON_INTERPRET=1``). Both give the same tokens for the same inputs.

Semantics (transformers' warpers, in their order): temperature, then top-k (``0`` or ``>= vocab``: off), then top-p
(``>= 1``: off), then min-p (``0``: off); temperature ``0`` means greedy (``argmax`` of the raw row). Ties at the
top-k / top-p boundary are kept together. The draw is exact sampling from the renormalised kept distribution, keyed
only on the row's (seed, offset), never on its batch. The preparation here is a handful of element-wise ops on
``[R]`` tensors (no host sync), so the call is safe under CUDA-graph capture on the Triton path.
"""

from __future__ import annotations

import torch

from . import _check_tensor, _triton_module, get_backend, reference_sampling

__all__ = ["sample_tokens"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Token ids ``[R]`` (int64, on the logits' device) of ``logits [R, V]``.

    Every other argument is a ``[R]`` tensor on the same device: ``temperature`` (float, 0 = greedy), ``top_k``
    (int), ``top_p`` and ``min_p`` (float), ``seed`` (int64, >= 0) and ``offset`` (int64, >= 0: where the row draws,
    e.g. its position). A row's token depends only on its logits and its own parameters.
    """
    _check_tensor("logits", logits, 2, _FLOATS)
    dev = logits.device
    rows, vocab = logits.shape
    for name, t, dtypes in (("temperature", temperature, _FLOATS), ("top_k", top_k, _INTS), ("top_p", top_p, _FLOATS),
                            ("min_p", min_p, _FLOATS), ("seed", seed, _INTS), ("offset", offset, _INTS)):
        _check_tensor(name, t, 1, dtypes, dev)
        if t.shape[0] != rows:
            raise ValueError(f"{name} must have shape [{rows}] (one entry per logits row), got {tuple(t.shape)}")
    if vocab == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    if vocab >= 2**31:
        raise ValueError(f"logits vocabulary {vocab} is too large (< 2**31)")
    temperature = temperature.float()
    inv_t = torch.where(temperature > 0, 1.0 / temperature.clamp_min(1e-30), torch.zeros_like(temperature))
    top_k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.zeros_like(top_k)).to(torch.int32)
    top_p = top_p.float()
    min_p = min_p.float()
    log_min_p = torch.where(min_p > 0, torch.log(min_p.clamp_min(1e-38)), torch.full_like(min_p, float("-inf")))
    args = (inv_t.contiguous(), top_k.contiguous(), top_p.contiguous(), log_min_p.contiguous(),
            seed.long().contiguous(), offset.long().contiguous())
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if get_backend(dev) == "triton":
        return _triton_module("triton_sampling").sample_tokens(logits, *args)
    return reference_sampling.sample_tokens(logits, *args).to(dev)
