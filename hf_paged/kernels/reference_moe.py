"""Plain-torch mixture-of-experts: the CPU path of :mod:`hf_paged.kernels.moe` and the oracle of its Triton kernels.

Semantics (the kernel contract; :mod:`hf_paged.kernels.moe` has the shapes): a token ``t`` routed to experts
``top_k_index[t, :]`` with weights ``top_k_weights[t, :]`` gets ``sum_k w[t, k] * down_e(act(up_e(x_t)))``, where
``up_e`` is expert ``e``'s up (or fused gate/up) projection plus its bias, ``act`` the :class:`Activation`, and
``down_e`` the down projection plus its bias. Routing slots are numbered ``p = t * K + k`` ("pairs"). An index
outside ``[0, E)`` (transformers' expert-parallel sentinel) contributes nothing. Rounding follows the Triton path:
projections accumulate in float32, the activation runs in float32 and is stored in the weights' dtype (the down
projection's input), each weighted expert output is stored in the hidden dtype, and the top-k sum runs in float32.
In float32 that is transformers' ``eager`` experts up to the order of the sums.

The loop visits only the experts some token was routed to (one host sync for the list), as transformers' eager
experts do: on the CPU that is the fastest plain-torch form at every row count.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Activation", "activate", "experts_up", "experts_down", "fused_experts", "naive_experts"]

_KINDS = ("silu", "gelu", "gelu_tanh", "identity")


class Activation(NamedTuple):
    """What the up projection's output goes through before the down projection.

    ``kind``: ``"silu"`` (``g * sigmoid(alpha * g)``), ``"gelu"`` (erf), ``"gelu_tanh"`` or ``"identity"``.
    ``gated``: the up projection has ``2 * I`` outputs, a gate half and an up half (``act(gate) * up``); else ``I``
    outputs go through ``act`` alone. ``interleaved``: the gate and up outputs alternate (gate ``2n``, up ``2n + 1``:
    gpt-oss) instead of the gate rows first (``[0, I)``, then up ``[I, 2I)``). The clamps of clamped SwiGLUs (inf:
    none): the gate is clamped above at ``gate_limit`` before the activation, the activation's output above at
    ``act_limit``, the up half to ``[-up_limit, up_limit]``, then ``up_shift`` is added to it. gpt-oss is
    ``silu, alpha=1.702, gate_limit=7, up_limit=7, up_shift=1``; a plain SwiGLU is ``Activation()``."""

    kind: str = "silu"
    gated: bool = True
    interleaved: bool = False
    alpha: float = 1.0
    gate_limit: float = math.inf
    act_limit: float = math.inf
    up_limit: float = math.inf
    up_shift: float = 0.0

    def check(self) -> Activation:
        """Self, or a ValueError naming the bad field."""
        if self.kind not in _KINDS:
            raise ValueError(f"activation kind must be one of {_KINDS}, got {self.kind!r}")
        for name in ("alpha", "gate_limit", "act_limit", "up_limit", "up_shift"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                raise ValueError(f"activation {name} must be a number, got {value!r}")
        return self

    @property
    def clamped(self) -> bool:
        return not (math.isinf(self.gate_limit) and math.isinf(self.act_limit) and math.isinf(self.up_limit)
                    and self.up_shift == 0.0)


def _act(x: torch.Tensor, kind: str, alpha: float) -> torch.Tensor:
    if kind == "silu":
        return x * torch.sigmoid(x * alpha) if alpha != 1.0 else F.silu(x)
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return x


def activate(raw: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``[S, N_up] -> [S, I]`` in float32 (float64 stays): the activation of raw up-projection outputs."""
    raw = raw if raw.dtype == torch.float64 else raw.float()
    if not activation.gated:
        return _act(raw, activation.kind, activation.alpha)
    if activation.interleaved:
        gate, up = raw[..., 0::2], raw[..., 1::2]
    else:
        gate, up = raw.chunk(2, dim=-1)
    gate = gate.clamp(max=activation.gate_limit) if math.isfinite(activation.gate_limit) else gate
    act = _act(gate, activation.kind, activation.alpha)
    act = act.clamp(max=activation.act_limit) if math.isfinite(activation.act_limit) else act
    if math.isfinite(activation.up_limit):
        up = up.clamp(-activation.up_limit, activation.up_limit)
    return act * (up + activation.up_shift) if activation.up_shift else act * up


def _expert_rows(top_k_index: torch.Tensor, num_experts: int):
    """``(expert, pairs)`` for every expert that some routing slot names, pairs as a 1-D int64 tensor."""
    flat = top_k_index.reshape(-1)
    for expert in torch.unique(flat).tolist():
        if 0 <= expert < num_experts:
            yield expert, (flat == expert).nonzero().squeeze(1)


def experts_up(hidden: torch.Tensor, top_k_index: torch.Tensor, w_up: torch.Tensor, up_bias: torch.Tensor | None,
               activation: Activation, out_features: int) -> torch.Tensor:
    """``[T*K, out_features]`` in the weights' dtype: row ``p`` is ``act(up_e(hidden[p // K]))`` for the expert ``e``
    of slot ``p`` (zeros for a dropped slot)."""
    top_k = top_k_index.shape[1]
    out = torch.zeros(top_k_index.numel(), out_features, dtype=w_up.dtype, device=hidden.device)
    for expert, pairs in _expert_rows(top_k_index, w_up.shape[0]):
        x = hidden[pairs // top_k].to(w_up.dtype)
        raw = F.linear(x.float(), w_up[expert].float(),
                       None if up_bias is None else up_bias[expert].float())
        out[pairs] = activate(raw, activation).to(out.dtype)
    return out


def experts_down(inter: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 w_down: torch.Tensor, down_bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, H]`` in ``out_dtype``: ``sum_k w[t, k] * down_e(inter[t * K + k])`` over the slots of each token."""
    tokens, top_k = top_k_index.shape
    partial = torch.zeros(tokens * top_k, w_down.shape[1], dtype=out_dtype, device=inter.device)
    weights = top_k_weights.reshape(-1).float()
    for expert, pairs in _expert_rows(top_k_index, w_down.shape[0]):
        y = F.linear(inter[pairs].to(w_down.dtype).float(), w_down[expert].float(),
                     None if down_bias is None else down_bias[expert].float())
        partial[pairs] = (y * weights[pairs, None]).to(out_dtype)
    return partial.view(tokens, top_k, -1).float().sum(dim=1).to(out_dtype)


def fused_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                  activation: Activation) -> torch.Tensor:
    """``experts_down(experts_up(...))``: see the module docstring."""
    inter = experts_up(hidden, top_k_index, w_up, up_bias, activation, w_down.shape[2])
    return experts_down(inter, top_k_index, top_k_weights, w_down, down_bias, hidden.dtype)


def naive_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                  activation: Activation) -> torch.Tensor:
    """The same sum token by token and slot by slot in float64, with no rounding in between: the tests' oracle."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            if not 0 <= e < w_up.shape[0]:
                continue
            raw = w_up[e].double() @ hidden[t].double()
            if up_bias is not None:
                raw = raw + up_bias[e].double()
            act = activate(raw[None], activation)[0]
            y = w_down[e].double() @ act
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[t] += float(top_k_weights[t, k]) * y
    return out
