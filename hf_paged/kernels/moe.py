"""Mixture-of-experts dispatchers: `fused_experts`, and its two halves `experts_up` / `experts_down`.

Contract (every tensor on one device; nothing here reads tensor values, so the calls are safe under CUDA-graph
capture on the Triton path):

* ``hidden [T, H]`` (float32 / float16 / bfloat16); ``top_k_index [T, K]`` (int32 / int64) and ``top_k_weights
  [T, K]`` (float): token ``t`` goes to experts ``top_k_index[t, k]`` with weights ``top_k_weights[t, k]``. An index
  outside ``[0, E)`` contributes nothing (transformers' expert-parallel sentinel).
* ``w_up [E, N_up, H]`` and ``w_down [E, H, I]``: each expert's weights as ``nn.Linear`` stores them (out, in), any
  strides (a transposed checkpoint layout is a ``transpose(1, 2)`` view, never a copy). ``N_up`` is ``2 * I`` for a
  gated activation (gate and up halves, see :class:`Activation`), ``I`` otherwise. ``up_bias [E, N_up]`` and
  ``down_bias [E, H]`` are optional.
* `fused_experts` returns ``[T, H]`` in the hidden dtype: ``sum_k w[t, k] * (down_e(act(up_e(x_t))) + b)``
  (:mod:`hf_paged.kernels.reference_moe` states the rounding). `experts_up` returns the ``[T * K, out]`` rows of
  the first half by routing slot (``p = t * K + k``), in the weights' dtype; with
  ``Activation(kind="identity", gated=False)`` they are the raw projections, for a module whose own gate function
  runs in between; `experts_down` takes such rows (``[T * K, I]``) and finishes the layer.

Backend: the Triton kernels of :mod:`hf_paged.kernels.triton_moe` on CUDA tensors when triton imports, the torch
reference otherwise; ``HF_PAGED_BACKEND`` overrides as for the other kernels (``triton`` on the CPU needs
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from . import _check_tensor, _check_triton_device, _triton_module, get_backend, reference_moe
from .reference_moe import Activation

__all__ = ["Activation", "fused_experts", "experts_up", "experts_down"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def _check_routing(top_k_index, top_k_weights, tokens: int | None, device) -> None:
    _check_tensor("top_k_index", top_k_index, 2, _INTS, device)
    if tokens is not None and top_k_index.shape[0] != tokens:
        raise ValueError(f"top_k_index must have one row per token ({tokens}), got {tuple(top_k_index.shape)}")
    if top_k_weights is not None:
        _check_tensor("top_k_weights", top_k_weights, 2, _FLOATS, device)
        if top_k_weights.shape != top_k_index.shape:
            raise ValueError(f"top_k_weights {tuple(top_k_weights.shape)} must have the shape of top_k_index "
                             f"{tuple(top_k_index.shape)}")


def _check_weight(name: str, weight, bias, bias_name: str, device) -> None:
    _check_tensor(name, weight, 3, _FLOATS, device)
    if bias is not None:
        _check_tensor(bias_name, bias, 2, _FLOATS, device)
        if bias.shape != weight.shape[:2]:
            raise ValueError(f"{bias_name} must have shape {tuple(weight.shape[:2])}, got {tuple(bias.shape)}")


def _check_up(hidden, top_k_index, w_up, up_bias, activation) -> int:
    """Checks of the first half; returns its output width (``I`` when gated, ``N_up`` otherwise)."""
    if not isinstance(activation, Activation):
        raise TypeError(f"activation must be an hf_paged.kernels.moe.Activation, got {type(activation).__name__}")
    activation.check()
    _check_tensor("hidden", hidden, 2, _FLOATS)
    _check_routing(top_k_index, None, hidden.shape[0], hidden.device)
    _check_weight("w_up", w_up, up_bias, "up_bias", hidden.device)
    if w_up.shape[2] != hidden.shape[1]:
        raise ValueError(f"w_up {tuple(w_up.shape)} must read the hidden size {hidden.shape[1]} (its last dim)")
    if activation.gated and w_up.shape[1] % 2:
        raise ValueError(f"a gated activation needs an even number of up rows (gate and up), got {w_up.shape[1]}")
    return w_up.shape[1] // 2 if activation.gated else w_up.shape[1]


def _routing_inputs(top_k_index, top_k_weights=None):
    ids = top_k_index.contiguous()
    return ids if top_k_weights is None else (ids, top_k_weights.contiguous())


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _use_triton(t: torch.Tensor) -> bool:
    if get_backend(t.device) != "triton":
        return False
    _check_triton_device(t)
    return True


def fused_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  activation: Activation = Activation(), config=None) -> torch.Tensor:
    """The experts of one layer: ``[T, H]`` (see the module docstring). ``config`` (Triton path only): a
    `triton_moe.MoeConfig` instead of the table's."""
    inter = _check_up(hidden, top_k_index, w_up, up_bias, activation)
    _check_routing(top_k_index, top_k_weights, hidden.shape[0], hidden.device)
    _check_weight("w_down", w_down, down_bias, "down_bias", hidden.device)
    if w_down.shape[0] != w_up.shape[0] or w_down.shape[1] != hidden.shape[1] or w_down.shape[2] != inter:
        raise ValueError(f"w_down must have shape {(w_up.shape[0], hidden.shape[1], inter)} (experts, hidden, "
                         f"intermediate), got {tuple(w_down.shape)}")
    if hidden.shape[0] == 0:
        return hidden.new_zeros(hidden.shape)
    ids, weights = _routing_inputs(top_k_index, top_k_weights)
    if _use_triton(hidden):
        return _triton_module("triton_moe").fused_experts(_rows(hidden), ids, weights, w_up, w_down, up_bias,
                                                          down_bias, activation, config)
    return reference_moe.fused_experts(hidden, ids, weights, w_up, w_down, up_bias, down_bias, activation)


def experts_up(hidden: torch.Tensor, top_k_index: torch.Tensor, w_up: torch.Tensor,
               up_bias: torch.Tensor | None = None, activation: Activation = Activation()) -> torch.Tensor:
    """The first half: ``[T * K, out]`` rows by routing slot (see the module docstring); a dropped slot's row is
    unspecified (never read by `experts_down`)."""
    out_features = _check_up(hidden, top_k_index, w_up, up_bias, activation)
    ids = _routing_inputs(top_k_index)
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, out_features, dtype=w_up.dtype)
    if _use_triton(hidden):
        triton_moe = _triton_module("triton_moe")
        config = triton_moe.choose_config(ids.numel(), w_up.shape[0], w_up.shape[2], out_features, out_features,
                                          w_up.element_size())
        return triton_moe.experts_up(_rows(hidden), ids, w_up, up_bias, activation, out_features, config)
    return reference_moe.experts_up(hidden, ids, w_up, up_bias, activation, out_features)


def experts_down(inter: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_down: torch.Tensor,
                 down_bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The second half: ``[T, H]`` in ``out_dtype`` (default ``inter``'s) from the ``[T * K, I]`` rows of
    `experts_up` (after the module's own gate function, if any)."""
    _check_tensor("inter", inter, 2, _FLOATS)
    _check_routing(top_k_index, top_k_weights, None, inter.device)
    _check_weight("w_down", w_down, down_bias, "down_bias", inter.device)
    if inter.shape != (top_k_index.numel(), w_down.shape[2]):
        raise ValueError(f"inter must have shape {(top_k_index.numel(), w_down.shape[2])} (one row per routing slot, "
                         f"the intermediate size), got {tuple(inter.shape)}")
    out_dtype = out_dtype or inter.dtype
    tokens = top_k_index.shape[0]
    if tokens == 0:
        return inter.new_zeros(0, w_down.shape[1], dtype=out_dtype)
    ids, weights = _routing_inputs(top_k_index, top_k_weights)
    if _use_triton(inter):
        triton_moe = _triton_module("triton_moe")
        config = triton_moe.choose_config(ids.numel(), w_down.shape[0], w_down.shape[1], w_down.shape[2],
                                          w_down.shape[2], w_down.element_size())
        return triton_moe.experts_down(_rows(inter), ids, weights, w_down, down_bias, out_dtype, config)
    return reference_moe.experts_down(inter, ids, weights, w_down, down_bias, out_dtype)
