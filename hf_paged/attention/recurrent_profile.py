"""`profile_state_specs`: the shapes and dtypes of a hybrid model's recurrent states, from one call of each mixer.

The engine sizes its memory with them before any request runs (`hf_paged.engine.pool_sizing`). Each mixer's own
forward runs once on two tokens of zeros with a recording `_StateView` (`hf_paged.attention.recurrent`), and once
more to learn whether its multi-token form resumes from a state (`_resumes_chunks`): a mixer that does not gets its
chunks that continue a sequence run one token at a time.
"""

from __future__ import annotations

import torch

from ..cache import StateSpec
from . import recurrent_families
from .recurrent import (
    _bound_forward,
    _call_layout,
    _LayerStates,
    _required_params,
    _StateView,
    mixer_modules,
    per_token_outputs,
)

__all__ = ["profile_state_specs"]


def profile_state_specs(model: torch.nn.Module) -> dict:
    """`{(layer_idx, kind, state_idx): StateSpec}` of every recurrent state of `model`: each mixer's own forward run
    once on two tokens of zeros with a recording view (no attention runs, nothing is kept). Each mixer module keeps
    its layer's list as `_hf_paged_state_layout` (what the compiled decode step gathers and commits)."""
    specs = {}
    resumes: dict[type, bool] = {}
    param = next(model.parameters())
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    hidden = int(config.hidden_size)
    with torch.no_grad():
        for module in mixer_modules(model):
            names, cache_arg = _call_layout(type(module))
            view = _StateView(int(module.layer_idx), None, None, False)
            x = torch.zeros((1, 2, hidden), dtype=param.dtype, device=param.device)
            original = module.__dict__.get("_hf_paged_forward", module.forward)
            view.commit(_own_forward(module, original, names[0], cache_arg, x, view))
            layout = []
            for (layer, kind, index), tensor in sorted(view.recorded.items()):
                specs[(layer, kind, index)] = StateSpec(tuple(tensor.shape[1:]), tensor.dtype)
                layout.append((kind, index, tuple(tensor.shape[1:]), tensor.dtype))
            # what the compiled decode step gathers and commits for this layer (the same for every layer of a kind)
            module._hf_paged_state_layout = tuple(layout)
            if type(module) not in resumes:  # (one check per mixer class)
                resumes[type(module)] = _resumes_chunks(module, original, names[0], cache_arg, hidden, param)
            module._hf_paged_token_chunks = not resumes[type(module)]
    return specs


def _own_forward(module, forward, hidden_name: str, cache_arg: str, x: torch.Tensor, view: _StateView,
                 start: int = 0) -> torch.Tensor:
    """The mixer's own `forward` on `x` (tokens from position `start`) with `view` as its cache (required arguments
    it does not read: None); its output tensor."""
    call = {**dict.fromkeys(_required_params(type(module))), hidden_name: x, cache_arg: view}
    bound = recurrent_families.binding(type(module))
    if bound is not None and bound.positions:
        call["position_ids"] = torch.arange(start, start + x.shape[1], device=x.device)[None]
    out = _bound_forward(forward, call, hidden_name, cache_arg, view, bound, module)
    if per_token_outputs(out, x):  # (Zaya: query, key and value, all compared)
        return torch.cat([t.float().flatten(2) for t in out], -1)
    return out[0] if isinstance(out, tuple) else out


def _resumes_chunks(module, forward, hidden_name: str, cache_arg: str, hidden: int, param: torch.Tensor) -> bool:
    """Whether the mixer's multi-token form starts from the state it is given: six tokens at once against four, then
    two more from their state; the error is measured against what dropping the state altogether changes. Mamba 1
    mixers (Mamba, FalconMamba, Jamba) scan every multi-token call from zero (transformers' own generate never resumes
    one; only their convolution window carries over: about a tenth of the difference), so a chunked prefill or a
    prefix-cache hit of theirs would lose the state: `_run_paged` runs such chunks one token at a time instead. The
    mixers that resume (Mamba 2, gated DeltaNet, short convolutions) agree to rounding (1e-7 of it in float32); a
    16-bit mixer misjudged by its rounding only runs slower, never wrong."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn((1, 6, hidden), generator=g).to(param.device, param.dtype)

    def run(tokens: torch.Tensor, view: _StateView, start: int = 0) -> torch.Tensor:
        return _own_forward(module, forward, hidden_name, cache_arg, tokens, view, start).float()

    layer = module.layer_idx
    expected = run(x, _StateView(layer, None, None, False))[:, 4:]
    first = _StateView(layer, None, None, False)
    run(x[:, :4], first)
    rest = _StateView(layer, None, None, True)
    for name in _LayerStates.__slots__:
        setattr(rest.layers.states, name, getattr(first.layers.states, name))
    error = (run(x[:, 4:], rest, 4) - expected).abs().max()
    history = (run(x[:, 4:], _StateView(layer, None, None, False), 4) - expected).abs().max()
    return bool(error <= 1e-2 * history)
