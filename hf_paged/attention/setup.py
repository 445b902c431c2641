"""`prepare_model(model)`: make a model's attention run through hf_paged (support check, registration, switch), and
its mixture-of-experts layers through hf_paged's fused experts (`hf_paged.attention.experts`) unless told otherwise.

Every entry point calls it (the engine, `hf_paged.enable`, the drop-in helpers). Layers above may add what they need
done to every prepared model with `on_prepare` (the generate integration installs its `generate()` override there),
so the engine needs no import of the integrations above it.
"""

from __future__ import annotations

from collections.abc import Callable

from . import adapters, experts, recurrent
from .functions import ATTENTION_NAME, register
from .support import check_supported

__all__ = ["prepare_model", "on_prepare", "release_model"]

_HOOKS: list[Callable] = []


def on_prepare(hook: Callable) -> Callable:
    """Run `hook(model)` at the end of every `prepare_model` (idempotent registration; usable as a decorator)."""
    if hook not in _HOOKS:
        _HOOKS.append(hook)
    return hook


def prepare_model(model, experts_implementation: str | None = experts.EXPERTS_NAME):
    """Check the model is supported (ValueError naming the feature otherwise), register the attention and mask
    functions, switch the model to them, switch its experts to `experts_implementation` (None: leave them; see
    `experts.select`), and run the `on_prepare` hooks. Returns the model."""
    experts.check_implementation(experts_implementation)
    check_supported(model)
    register()
    text_config = model.config.get_text_config(decoder=True)
    if ATTENTION_NAME not in (model.config._attn_implementation, text_config._attn_implementation):
        model._hf_paged_previous_attn = model.config._attn_implementation  # what `hf_paged.disable` restores
        adapters.switch_implementation(model, ATTENTION_NAME)
    if text_config._attn_implementation != ATTENTION_NAME:
        # composite models: the switch must reach the decoder (a vision tower may keep its own implementation)
        raise ValueError(
            f"{type(model).__name__}: switching the attention implementation to {ATTENTION_NAME!r} did not reach its "
            f"text model (it runs {text_config._attn_implementation!r}); hf-paged cannot route its attention")
    experts.select(model, experts_implementation)
    adapters.install(model)  # families that compute attention themselves: their attention routed per instance
    recurrent.install(model)  # hybrid models: each recurrent mixer's state in a slot of the paged cache
    for hook in _HOOKS:
        hook(model)
    return model


def release_model(model, attn_implementation: str) -> None:
    """Undo what `prepare_model` changed on the model's modules: the attention adapters come off, the attention
    implementation becomes `attn_implementation` and the experts implementations are those it had before
    (`hf_paged.disable`)."""
    adapters.uninstall(model)
    experts.restore(model)
    adapters.switch_implementation(model, attn_implementation)
