"""The `hf_paged` experts implementation: transformers' MoE layers through hf_paged's fused-experts kernels.

transformers 5 routes every experts module decorated with `@use_experts_implementation` (Mixtral, Qwen2/3-MoE,
OLMoE, gpt-oss, Granite-MoE, Jamba, GLM-4-MoE, ...) through `ExpertsInterface`: the module's `forward(hidden [T, H],
top_k_index [T, K], top_k_weights [T, K])` calls `ALL_EXPERTS_FUNCTIONS.get_interface(config._experts_implementation,
eager_forward)(self, ...)`. `register()` adds `experts_forward` there under `EXPERTS_NAME`, as the attention function
is added to `AttentionInterface`; `select(model, name)` (called by `prepare_model`, so by `enable` and `Engine`)
switches a model's experts to it and keeps the previous choice for `restore` (`hf_paged.disable`).

What the decorator gives a module (read from transformers 5.17's `integrations/moe.py` and the modeling files):
`has_gate` (`gate_up_proj [E, 2I, H]`, else `up_proj [E, I, H]`), `is_transposed` (weights stored (in, out):
`[E, H, 2I]` and `down_proj [E, I, H]`: gpt-oss), `is_concatenated` (gate rows then up rows; False: interleaved,
gpt-oss), `has_bias` (`gate_up_proj_bias [E, 2I]` / `up_proj_bias`, `down_proj_bias [E, H]`), and the gate function
`_apply_gate(gate_up) -> [.., I]` (default: `act_fn(gate) * up`; gpt-oss, MiniMax-M3 and DeepSeek-V4 override it
with clamped SwiGLUs). The kernels take the weights through strides (a transposed layout is a view).

`experts_spec(module)` reads that once per module. The activation is fused into the first GEMM's epilogue only when
a `kernels.moe.Activation` reproduces the module's own `_apply_gate` (or `act_fn`) on a probe spanning the clamps
(float32, CPU, at set-up): SiLU / GELU / tanh-GELU gates and the clamped SwiGLUs above. Any other gate function
still runs, in torch, between the two grouped GEMMs (`experts_up` raw, the module's gate, `experts_down`). A module
whose weights the kernels cannot read (missing or mis-shaped tensors, quantized or distributed weights) has no spec:
`select` leaves that model on transformers' implementation (a debug log says why), and a call that reaches
`experts_forward` anyway runs transformers' `grouped_mm` experts.

Under `torch.compile` (the engine's compiled decode step) the kernels are opaque custom ops (`hf_paged::moe_experts`,
`hf_paged::moe_experts_up` / `_down`), so Dynamo traces the router around them and never the launch code.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, grouped_mm_experts_forward

from ..kernels import moe as moe_kernels
from ..kernels.moe import Activation
from ..kernels.reference_moe import activate

logger = logging.getLogger(__name__)

EXPERTS_NAME = "hf_paged"

__all__ = ["EXPERTS_NAME", "ExpertsSpec", "check_implementation", "experts_forward", "experts_modules", "experts_spec",
           "register", "restore", "select"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_SPEC_ATTR = "_hf_paged_experts_spec"
_PREVIOUS_ATTR = "_hf_paged_previous_experts"
_LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


class ExpertsSpec(NamedTuple):
    """How one experts module maps onto the kernels: its layout flags and the fused activation (None: the module's
    own gate function runs in torch between the GEMMs)."""

    gated: bool
    transposed: bool
    has_bias: bool
    activation: Activation | None

    def weights(self, module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """``(w_up [E, N_up, H], up_bias, w_down [E, H, I], down_bias)`` of `module` in the kernels' layout."""
        w_up = module.gate_up_proj if self.gated else module.up_proj
        w_down = module.down_proj
        if self.transposed:
            w_up, w_down = w_up.transpose(1, 2), w_down.transpose(1, 2)
        if not self.has_bias:
            return w_up, None, w_down, None
        up_bias = module.gate_up_proj_bias if self.gated else module.up_proj_bias
        return w_up, up_bias, w_down, module.down_proj_bias


# ------------------------------------------------------------------------------------------------------ the spec
def _plain_tensor(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype in _FLOATS and t.device.type != "meta"
            and not hasattr(t, "to_local"))  # DTensor shards: transformers' own implementation handles them


def _layout(module) -> ExpertsSpec | None:
    """The layout flags, if every weight the kernels read is a plain float tensor of a consistent shape."""
    if not all(isinstance(getattr(module, flag, None), bool) for flag in _LAYOUT_FLAGS):
        return None
    spec = ExpertsSpec(module.has_gate, module.is_transposed, module.has_bias, None)
    try:
        w_up, up_bias, w_down, down_bias = spec.weights(module)
    except AttributeError:
        return None
    tensors = [w_up, w_down] + ([up_bias, down_bias] if spec.has_bias else [])
    if not all(_plain_tensor(t) for t in tensors) or w_up.dim() != 3 or w_down.dim() != 3:
        return None
    if len({t.device for t in tensors}) != 1:
        return None
    experts, up_rows, hidden = w_up.shape
    inter = up_rows // 2 if spec.gated else up_rows
    if w_down.shape != (experts, hidden, inter) or (spec.gated and up_rows % 2):
        return None
    if spec.has_bias and (up_bias.shape != (experts, up_rows) or down_bias.shape != (experts, hidden)):
        return None
    num_experts = getattr(module, "num_experts", experts)
    if isinstance(num_experts, int) and num_experts != experts:
        return None
    return spec


def _probe(width: int, scale: float) -> torch.Tensor:
    """Fixed float32 values in ``[-scale, scale]``, beyond every clamp of the candidates."""
    generator = torch.Generator().manual_seed(0)
    return (torch.rand(4, width, generator=generator) * 2 - 1) * scale


def _candidates(module, gated: bool, interleaved: bool) -> list[Activation]:
    plain = [Activation(kind, gated=gated, interleaved=interleaved) for kind in ("silu", "gelu", "gelu_tanh")]
    limit = next((v for v in (getattr(module, "limit", None), getattr(module, "swiglu_limit", None))
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)), None)
    if not gated or limit is None:
        return plain
    alpha = next((v for v in (getattr(module, "alpha", None), getattr(module, "swiglu_alpha", None))
                  if isinstance(v, (int, float)) and not isinstance(v, bool)), 1.0)
    clamped = [Activation("silu", gated=True, interleaved=interleaved, alpha=float(a), gate_limit=gate_limit,
                          act_limit=act_limit, up_limit=float(limit), up_shift=shift)
               for a in dict.fromkeys((alpha, 1.0)) for shift in (1.0, 0.0)
               for gate_limit, act_limit in ((float(limit), math.inf), (math.inf, float(limit)))]
    return clamped + plain


def _fused_activation(module, spec: ExpertsSpec, up_rows: int) -> Activation | None:
    """The `Activation` that reproduces the module's gate function on a probe, or None (the module's own runs)."""
    interleaved = spec.gated and not module.is_concatenated
    candidates = _candidates(module, spec.gated, interleaved)
    scale = max([12.0] + [2 * c.up_limit for c in candidates if math.isfinite(c.up_limit)])
    probe = _probe(up_rows, scale)
    try:
        with torch.no_grad():
            expected = module._apply_gate(probe) if spec.gated else module.act_fn(probe)
    except Exception as error:  # a gate function that needs more than its input: keep calling it
        logger.debug("%s: its gate function failed on a probe (%s); it runs unfused", type(module).__name__, error)
        return None
    if not isinstance(expected, torch.Tensor) or expected.shape != (4, up_rows // 2 if spec.gated else up_rows):
        return None
    for candidate in candidates:
        if torch.allclose(activate(probe, candidate), expected.float(), rtol=1e-5, atol=1e-6):
            return candidate
    return None


@torch.compiler.disable
def experts_spec(module) -> ExpertsSpec | None:
    """The module's `ExpertsSpec` (computed once and kept on the module), None when the kernels cannot run it."""
    cached = module.__dict__.get(_SPEC_ATTR, False)
    if cached is not False:
        return cached
    spec = _layout(module)
    if spec is not None:
        up_rows = spec.weights(module)[0].shape[1]
        spec = spec._replace(activation=_fused_activation(module, spec, up_rows))
    module.__dict__[_SPEC_ATTR] = spec
    return spec


# --------------------------------------------------------------------------------------------------- the forward
@torch.library.custom_op("hf_paged::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor, up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, kind: str,
                gated: bool, interleaved: bool, alpha: float, gate_limit: float, act_limit: float, up_limit: float,
                up_shift: float) -> torch.Tensor:
    """`kernels.moe.fused_experts` as one opaque op of a compiled graph (the activation's fields spelled out)."""
    activation = Activation(kind, gated, interleaved, alpha, gate_limit, act_limit, up_limit, up_shift)
    return moe_kernels.fused_experts(hidden, top_k_index, top_k_weights, w_up, w_down, up_bias, down_bias, activation)


@moe_experts.register_fake
def _(hidden, top_k_index, top_k_weights, w_up, w_down, up_bias, down_bias, *activation):
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("hf_paged::moe_experts_up", mutates_args=())
def moe_experts_up(hidden: torch.Tensor, top_k_index: torch.Tensor, w_up: torch.Tensor,
                   up_bias: torch.Tensor | None) -> torch.Tensor:
    """`kernels.moe.experts_up` with no activation (the raw projections), opaque to the compiler."""
    return moe_kernels.experts_up(hidden, top_k_index, w_up, up_bias, Activation("identity", gated=False))


@moe_experts_up.register_fake
def _(hidden, top_k_index, w_up, up_bias):
    return w_up.new_empty(top_k_index.numel(), w_up.shape[1])


@torch.library.custom_op("hf_paged::moe_experts_down", mutates_args=())
def moe_experts_down(inter: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     w_down: torch.Tensor, down_bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`kernels.moe.experts_down`, opaque to the compiler."""
    return moe_kernels.experts_down(inter, top_k_index, top_k_weights, w_down, down_bias, out_dtype)


@moe_experts_down.register_fake
def _(inter, top_k_index, top_k_weights, w_down, down_bias, out_dtype):
    return inter.new_empty(top_k_index.shape[0], w_down.shape[1], dtype=out_dtype)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """What `ALL_EXPERTS_FUNCTIONS["hf_paged"]` runs for an experts module: ``[T, H]`` in the hidden dtype."""
    spec = getattr(self, _SPEC_ATTR, False)  # set at `select`: a plain attribute read, no graph break when traced
    if spec is False:
        spec = experts_spec(self)
    if spec is None:  # the kernels cannot read this module's weights: transformers' default implementation
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    w_up, up_bias, w_down, down_bias = spec.weights(self)
    compiling = torch.compiler.is_compiling()
    if spec.activation is not None:
        if compiling:
            return torch.ops.hf_paged.moe_experts(hidden_states, top_k_index, top_k_weights, w_up, w_down, up_bias,
                                                  down_bias, *spec.activation)
        return moe_kernels.fused_experts(hidden_states, top_k_index, top_k_weights, w_up, w_down, up_bias, down_bias,
                                     spec.activation)
    if compiling:
        raw = torch.ops.hf_paged.moe_experts_up(hidden_states, top_k_index, w_up, up_bias)
    else:
        raw = moe_kernels.experts_up(hidden_states, top_k_index, w_up, up_bias, Activation("identity", gated=False))
    inter = (self._apply_gate(raw) if spec.gated else self.act_fn(raw)).contiguous()
    if compiling:
        return torch.ops.hf_paged.moe_experts_down(inter, top_k_index, top_k_weights, w_down, down_bias,
                                                   hidden_states.dtype)
    return moe_kernels.experts_down(inter, top_k_index, top_k_weights, w_down, down_bias, hidden_states.dtype)


# ---------------------------------------------------------------------------------------- registration and switch
_registered = False


def register() -> str:
    """Add `experts_forward` to transformers' `ExpertsInterface` as `EXPERTS_NAME` (idempotent)."""
    global _registered
    if not _registered:
        ExpertsInterface.register(EXPERTS_NAME, experts_forward)
        _registered = True
    return EXPERTS_NAME


def experts_modules(model) -> list[torch.nn.Module]:
    """The modules of `model` that transformers' `@use_experts_implementation` dispatches."""
    return [m for m in model.modules()
            if all(hasattr(m, flag) for flag in _LAYOUT_FLAGS) and hasattr(getattr(m, "config", None),
                                                                           "_experts_implementation")]


def check_implementation(implementation) -> None:
    """A TypeError / ValueError naming `experts_implementation` unless it is None or a name transformers'
    `ExpertsInterface` knows (``"hf_paged"``, ``"eager"``, ``"grouped_mm"``, ``"batched_mm"``, ...)."""
    if implementation is None:
        return
    if not isinstance(implementation, str):
        raise TypeError(f"experts_implementation must be a str or None, got {type(implementation).__name__}")
    register()
    known = ["eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()]
    if implementation not in known:
        raise ValueError(f"experts_implementation must be None or one of {sorted(known)}, got {implementation!r}")


def select(model, implementation: str | None = EXPERTS_NAME) -> bool:
    """Switch `model`'s experts to `implementation` (None: leave them as they are); returns whether it switched.

    The first switch keeps the model's previous implementations (`get_experts_implementation()`) for `restore`. A
    model whose experts the hf_paged kernels cannot read stays on its implementation (debug log). Raises as
    `check_implementation` does for a name transformers does not know."""
    check_implementation(implementation)
    if implementation is None:
        return False
    modules = experts_modules(model)
    if not modules or not hasattr(model, "set_experts_implementation"):
        return False
    name = type(model).__name__
    if implementation == EXPERTS_NAME:
        unreadable = sorted({type(m).__name__ for m in modules if experts_spec(m) is None})
        if unreadable:
            logger.debug("%s keeps transformers' experts implementation: hf_paged's kernels cannot read the "
                         "weights of %s", name, ", ".join(unreadable))
            return False
    if all(m.config._experts_implementation == implementation for m in modules):
        return False
    previous = model.get_experts_implementation()
    try:
        model.set_experts_implementation(implementation)
    except (ValueError, RuntimeError) as error:
        if implementation != EXPERTS_NAME:
            raise
        logger.debug("%s keeps transformers' experts implementation: %s", name, error)
        return False
    model.__dict__.setdefault(_PREVIOUS_ATTR, previous)
    missed = sorted({type(m).__name__ for m in modules if m.config._experts_implementation != implementation})
    if missed:
        logger.debug("%s: the experts switch to %r did not reach %s", name, implementation, ", ".join(missed))
    return True


def restore(model) -> None:
    """Give `model` back the experts implementations it had before the first `select` (no-op otherwise)."""
    previous = model.__dict__.pop(_PREVIOUS_ATTR, None)
    if previous is not None:
        model.set_experts_implementation(previous)
