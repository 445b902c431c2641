"""`prepare_model(model)`: make a model's attention run through hf_paged (support check, registration, switch).

Every entry point calls it (the engine, `hf_paged.enable`, the drop-in helpers). Layers above may add what they need
done to every prepared model with `on_prepare` (the generate integration installs its `generate()` override there),
so the engine needs no import of the integrations above it.
"""

from __future__ import annotations

from collections.abc import Callable

from .functions import ATTENTION_NAME, register
from .support import check_supported

__all__ = ["prepare_model", "on_prepare"]

_HOOKS: list[Callable] = []


def on_prepare(hook: Callable) -> Callable:
    """Run `hook(model)` at the end of every `prepare_model` (idempotent registration; usable as a decorator)."""
    if hook not in _HOOKS:
        _HOOKS.append(hook)
    return hook


def prepare_model(model):
    """Check the model is supported (ValueError naming the feature otherwise), register the attention and mask
    functions, switch the model to them, and run the `on_prepare` hooks. Returns the model."""
    check_supported(model)
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    for hook in _HOOKS:
        hook(model)
    return model
