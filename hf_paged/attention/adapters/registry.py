"""The adapter registry: which attention classes have an adapter, and installing them on a model's instances.

An adapter replaces one method of an attention module *instance* (its `forward`, or the inner method where the family
computes attention from the K/V the cache returned, such as GPT-J's `_attn`), the way `recurrent.install` wraps the
recurrent mixers and Liger Kernel patches its kernels in: the class, the modeling file and every other instance stay
as they are. The replacement runs only while the model's attention implementation is one that routes adapted modules
(`hf_paged`, registered by `functions.register`, and the run-time probe's); any other implementation gets the
module's own method, so an adapter never changes what a model computes outside hf-paged. `uninstall` restores the
instances.

Where the family computes attention, an adapter calls :func:`attend`: the registered attention function of the
model's implementation, called as an interface-routed module calls it after `Cache.update()` (module, query
`[B, Hq, q, D]`, the K/V `update()` returned, the model's mask, `scaling`, and options such as `sliding_window` and
`alibi_slopes`). So the paged attention, the compiled step's fused op and the run-time probe see an adapted module
exactly as they see an interface-routed one.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["Adapter", "register", "adapter_for", "refusal", "adapted_modules", "install", "uninstall", "attend",
           "route_through", "switch_implementation", "family_module", "needs_mask_tensor"]


@dataclass(frozen=True)
class Adapter:
    """How one attention class is adapted.

    `method`: the instance attribute replaced (`"forward"`, or the family's inner attention method). `run(module,
    *args, **kwargs)`: the replacement, called with what the model's code passes to that method. `handles`: gate
    features the adapter takes care of (`no_position_ids` for an ALiBi family whose only positions are the biases the
    kernels compute). `refuse(module)`: the reason a variant of the family is not handled (None when it is).
    `prepare(module)`: tensors the adapter reads on every call (ALiBi slopes), computed once at install and kept as
    non-persistent buffers of the instance (so they follow `model.to(...)` and stay out of the state dict).
    `mask_tensor`: the family's model code uses the mask `create_causal_mask` returns as a tensor even when there is
    no padding (MPT calls `.to(torch.bool)` on it), so hf-paged's mask function returns one for its config
    (:func:`needs_mask_tensor`) where it would return None.
    """

    family: str
    method: str
    run: Callable
    handles: frozenset[str] = field(default_factory=frozenset)
    refuse: Callable[[torch.nn.Module], str | None] | None = None
    prepare: Callable[[torch.nn.Module], dict[str, torch.Tensor]] | None = None
    mask_tensor: bool = False


_ADAPTERS: dict[str, Adapter] = {}
# attention implementations under which an installed adapter routes its module (the others run the module's own code)
_ROUTED: set[str] = set()
# configs of adapted models whose code needs a mask tensor (`Adapter.mask_tensor`), by id (configs are not hashable)
_MASK_TENSOR: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register(*class_paths: str, adapter: Adapter) -> Adapter:
    """Adapt the attention classes at `class_paths` ("transformers.models.gptj.modeling_gptj.GPTJAttention"): exact
    classes only, never their subclasses (a flash-attention subclass computes attention another way)."""
    for path in class_paths:
        _ADAPTERS[path] = adapter
    return adapter


def adapter_for(cls: type) -> Adapter | None:
    """The adapter registered for exactly this class, or None."""
    return _ADAPTERS.get(_qualname(cls))


def refusal(module: torch.nn.Module) -> str | None:
    """Why `module` cannot be adapted ("no adapter", or the adapter's reason for this variant); None when it can."""
    adapter = adapter_for(type(module))
    if adapter is None:
        return "no adapter"
    return adapter.refuse(module) if adapter.refuse is not None else None


def adapted_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` that `install` adapts (those with an adapter that handles their variant)."""
    return [m for m in model.modules() if adapter_for(type(m)) is not None and refusal(m) is None]


def family_module(module: torch.nn.Module) -> types.ModuleType:
    """The modeling module of `module`'s family (loaded, since its class is): adapters call its own helpers from it
    (`apply_rotary_pos_emb`, `dropout_add`, ...), never a copy of them."""
    return sys.modules[type(module).__module__]


def needs_mask_tensor(config) -> bool:
    """Whether the model of `config` has an installed adapter that needs a mask tensor (see `Adapter.mask_tensor`)."""
    return config is not None and _MASK_TENSOR.get(id(config)) is config


def route_through(name: str) -> None:
    """Installed adapters route their modules while the model's attention implementation is `name`."""
    _ROUTED.add(name)


def _dispatch(module: torch.nn.Module, *args, **kwargs):
    """The installed method: the adapter under a routing implementation, the module's own method otherwise."""
    if module._hf_paged_attn_config._attn_implementation in _ROUTED:
        return module._hf_paged_adapter.run(module, *args, **kwargs)
    return module._hf_paged_original(*args, **kwargs)


def install(model: torch.nn.Module) -> int:
    """Install the adapters on every adaptable module of `model` (idempotent); returns how many are adapted."""
    text_config = model.config.get_text_config(decoder=True)
    modules = adapted_modules(model)
    for module in modules:
        if "_hf_paged_adapter" in module.__dict__:
            continue
        adapter = adapter_for(type(module))
        module._hf_paged_adapter = adapter
        module._hf_paged_original = getattr(module, adapter.method)
        # the config whose implementation decides (the module's own where it keeps one: the same object as the model's)
        module._hf_paged_attn_config = getattr(module, "config", None) or text_config
        if adapter.mask_tensor:
            _MASK_TENSOR[id(module._hf_paged_attn_config)] = module._hf_paged_attn_config
        if not isinstance(getattr(module, "layer_idx", None), int) and isinstance(getattr(module, "layer_id", None),
                                                                                  int):
            module.layer_idx = module.layer_id  # GPT-Neo: the attention function and the compiled op read layer_idx
            module._hf_paged_layer_alias = True
        buffers = adapter.prepare(module) if adapter.prepare is not None else {}
        device = next(iter(module.parameters()), torch.empty(0)).device
        for name, tensor in buffers.items():
            module.register_buffer(name, tensor.to(device), persistent=False)
        module._hf_paged_buffers = tuple(buffers)
        setattr(module, adapter.method, types.MethodType(_dispatch, module))
    return len(modules)


def uninstall(model: torch.nn.Module) -> None:
    """Undo `install`."""
    for module in model.modules():
        adapter = module.__dict__.pop("_hf_paged_adapter", None)
        if adapter is None:
            continue
        original = module.__dict__.pop("_hf_paged_original")
        module.__dict__.pop("_hf_paged_attn_config", None)
        for name in module.__dict__.pop("_hf_paged_buffers", ()):
            module._buffers.pop(name, None)
        if module.__dict__.pop("_hf_paged_layer_alias", False):
            module.__dict__.pop("layer_idx", None)
        if isinstance(original, types.MethodType) and original.__func__ is getattr(type(module), adapter.method, None):
            module.__dict__.pop(adapter.method, None)
        else:
            setattr(module, adapter.method, original)


def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, scaling: float, **options) -> torch.Tensor:
    """Call the registered attention function of the model's implementation as an interface-routed module does:
    `query [B, Hq, q, D]`, the K/V `Cache.update()` returned (or the new ones without a cache), the model's mask;
    returns `[B, q, Hq, Dv]`. `options`: `sliding_window`, `alibi_slopes` (None entries are left out)."""
    function = ALL_ATTENTION_FUNCTIONS[module._hf_paged_attn_config._attn_implementation]
    options = {k: v for k, v in options.items() if v is not None}
    out, _ = function(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **options)
    return out


def _configs(model: torch.nn.Module) -> list:
    seen: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def switch_implementation(model: torch.nn.Module, name: str) -> None:
    """`model.set_attn_implementation(name)`; a model transformers will not switch (its modeling file does not use
    `AttentionInterface`, so it only warns) whose attention modules have adapters is switched on its configs
    directly: its masks then come from `name`'s mask function, and its adapted modules route through `name`."""
    can_set = getattr(model, "_can_set_attn_implementation", lambda: True)
    if can_set() or not adapted_modules(model):
        model.set_attn_implementation(name)
        return
    for config in _configs(model):
        config._attn_implementation_internal = name
