"""Has what the model computes changed since the engine last looked? (so cached K/V never outlives its weights)

The prefix cache serves K/V that earlier requests computed. That is only right while the weights that computed it
are the weights in use: after an optimizer step, `load_state_dict`, a dtype/device move or a PEFT adapter switch, a
cached block holds K/V no current forward would produce, and serving it is a silent wrong result. `WeightWatch`
tells the engine when that happened, cheaply enough to ask before every admission of new requests:

* in-place updates (optimizer steps, `load_state_dict` copying into the parameters, `merge_adapter`): every tensor
  keeps a version counter that each in-place operation bumps (`tensor._version`);
* storage swaps (`param.data = ...`, `model.to(dtype/device)`, which rebinds `.data`): the data pointer changes;
* replaced parameters, buffers or submodules (`module.weight = nn.Parameter(...)`, `load_state_dict(assign=True)`,
  PEFT injecting or unloading adapter layers): torch's global module registration hooks bump a process-wide epoch;
  a changed epoch triggers a full re-fingerprint (names, identities, versions, pointers) compared with the last;
* PEFT adapter state that is not a tensor (`enable_adapter_layers` / `disable_adapter_layers`, `set_adapter`, the
  `disable_adapter()` context): the active adapters, the disabled flag and the merged adapters of every tuner layer.

The fast path is one pass over the model's tensors comparing two integers each (~0.2 us per tensor; measured in
`benchmarks/bench_weight_watch.py`). Tensors are held by weak reference: the watch never keeps old weights alive.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["WeightChange", "WeightWatch"]

_EPOCH = [0]  # bumped whenever any module anywhere registers a parameter, buffer or submodule
_HOOKS_INSTALLED = False


def _bump(*_args) -> None:
    # Models build modules inside forward (llama slices `self.layers[:n]`, a new ModuleList): under torch.compile
    # that registration is traced, and a global mutated there would cost a graph break and a recompile per call.
    # A module built while compiling is a temporary of the forward, never a weight change.
    if torch.compiler.is_dynamo_compiling():
        return
    _EPOCH[0] += 1


def _install_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    from torch.nn.modules import module as nn_module

    nn_module.register_module_parameter_registration_hook(_bump)
    nn_module.register_module_buffer_registration_hook(_bump)
    nn_module.register_module_module_registration_hook(_bump)
    _HOOKS_INSTALLED = True


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter: their pointer is all we can watch
        return -1


@dataclass(frozen=True)
class WeightChange:
    """What changed. `storage`: some tensor now lives elsewhere or has another dtype (captured CUDA graphs read the
    old addresses and must be re-captured); `dtype` / `device`: the model's first parameter moved."""

    storage: bool
    dtype: torch.dtype
    device: torch.device


def _tuner_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT's tuner layers (LoRA & co): modules carrying adapter state that is not a tensor."""
    return [m for m in model.modules() if hasattr(m, "merged_adapters") and hasattr(m, "active_adapters")]


def _adapter_state(layers: list[torch.nn.Module]) -> tuple:
    state = []
    for layer in layers:
        active = layer.active_adapters
        state.append((tuple(active) if isinstance(active, (list, tuple)) else active,
                      bool(getattr(layer, "disable_adapters", False)), tuple(layer.merged_adapters)))
    return tuple(state)


class WeightWatch:
    """Fingerprint of the weights a model computes with; `check()` says whether they changed since the last call."""

    def __init__(self, model_ref) -> None:
        _install_hooks()
        self._model_ref = model_ref
        self.checks = 0
        self.changes = 0
        self._snapshot(model_ref())

    def _tensors(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        return list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if b is not None]

    def _snapshot(self, model: torch.nn.Module) -> None:
        named = self._tensors(model)
        self._epoch = _EPOCH[0]
        self._entries = [(weakref.ref(t), _version(t), t.data_ptr()) for _, t in named]
        self._identity = tuple((n, id(t), t.dtype, t.device) for n, t in named)
        self._layers = [weakref.ref(m) for m in _tuner_layers(model)]
        self._adapters = _adapter_state([m for m in (r() for r in self._layers) if m is not None])
        first = next(model.parameters())
        self._dtype, self._device = first.dtype, first.device

    def check(self) -> WeightChange | None:
        """None when the model computes what it computed at the last check (or at construction); else what changed.
        The new state becomes the reference either way."""
        self.checks += 1
        model = self._model_ref()
        changed = storage = False
        if _EPOCH[0] != self._epoch:  # something (anywhere) registered a tensor or module: compare identities
            named = self._tensors(model)
            identity = tuple((n, id(t), t.dtype, t.device) for n, t in named)
            storage = identity != self._identity
            changed = storage
        if not changed:
            for ref, version, ptr in self._entries:
                t = ref()
                if t is None or t.data_ptr() != ptr:
                    changed = storage = True
                    break
                if t._version != version and version != -1:
                    changed = True
                    break
        if not changed and self._layers:
            layers = [m for m in (r() for r in self._layers) if m is not None]
            changed = len(layers) != len(self._layers) or _adapter_state(layers) != self._adapters
        if not changed:
            self._epoch = _EPOCH[0]
            return None
        self.changes += 1
        self._snapshot(model)
        return WeightChange(storage=storage, dtype=self._dtype, device=self._device)
