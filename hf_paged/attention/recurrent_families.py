"""Recurrent families that keep their state outside transformers' usual cache calls: a hook or binding per family.

`hf_paged.attention.recurrent` slots the state of every mixer that reaches it through the cache it is handed (the
`_StateView` answering ``update_conv_state`` / ``update_recurrent_state``, and MiniMax's ``get_linear_cache`` /
``set_linear_cache``). Some families need one more thing, named here per family, on the instances of their own
classes (never a copied modeling file: their projections, recurrences and weights run as written):

* **model hooks** (`MODEL_HOOKS`, forward pre-hooks with keyword arguments on a model class): MiniMax's `MiniMaxModel`
  raises a ValueError for any cache but its own `MiniMaxCache` when ``use_cache`` is on, although its layers only
  call `update` (attention) and `get_linear_cache` / `set_linear_cache` (lightning attention) on it, and ``use_cache``
  does nothing else there. Handed a `PagedCache` (or the run-time probe's recording cache, which answers those
  calls), it runs with ``use_cache=False``: the cache is still passed to every layer and returned.
* **state bindings** (`BINDINGS`, on a mixer class): where a mixer that never calls its cache keeps its state, so that
  `recurrent._Call.run` can put a group's slots there before the module's own forward runs and take the new states
  back after it (then clear the module, which keeps nothing between calls). RecurrentGemma's recurrent block keeps
  its convolution window in ``self.conv1d_state`` and its RG-LRU state in ``self.rg_lru.recurrent_states`` (module
  attributes, one batch at a time), reads ``position_ids`` (its RG-LRU resets at position 0, and a call of one
  token takes its decode branch), and is given no layer index: it gets its decoder layer's (`layer_index`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache import PagedCache

__all__ = ["MODEL_HOOKS", "BINDINGS", "Binding", "binding", "model_hook", "layer_index"]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _minimax_own_cache_only(module, args: tuple, kwargs: dict):
    """`MiniMaxModel`'s pre-hook (module doc): a `PagedCache` passes its check with ``use_cache`` off."""
    cache = kwargs.get("past_key_values")
    if kwargs.get("use_cache") is False or cache is None:
        return None
    if isinstance(cache, PagedCache) or callable(getattr(cache, "get_linear_cache", None)):
        return args, {**kwargs, "use_cache": False}
    return None


MODEL_HOOKS: dict[str, Callable] = {
    "transformers.models.minimax.modeling_minimax.MiniMaxModel": _minimax_own_cache_only,
}


def model_hook(cls: type) -> Callable | None:
    """The forward pre-hook installed on instances of exactly `cls` (None: none)."""
    return MODEL_HOOKS.get(_qualname(cls))


@dataclass(frozen=True)
class Binding:
    """Where one mixer class keeps its state during a call of its own forward (module doc).

    `cache_arg`: the argument the model's code hands the cache under (the mixer's own, or one of its ``**kwargs``).
    `load(module, states, hidden)`: put `states` (a `recurrent._LayerStates`: ``conv_states`` / ``recurrent_states``
    by state index, empty when the rows start fresh) where the module reads them; returns what to pass as
    `cache_arg` (None: leave the caller's). `store(module, passed, states)`: move what the call left into `states`
    and clear the module. `positions`: the forward reads ``position_ids``, sliced per group of rows.
    """

    family: str
    cache_arg: str
    load: Callable[[torch.nn.Module, object, torch.Tensor], object]
    store: Callable[[torch.nn.Module, object, object], None]
    positions: bool = False


def _recurrent_gemma_load(module, states, hidden):
    # (None when fresh: the block allocates its zeros itself, as under transformers' own first forward)
    module.conv1d_state = states.conv_states.get(0)
    module.rg_lru.recurrent_states = states.recurrent_states.get(0)
    return None


def _recurrent_gemma_store(module, passed, states) -> None:
    conv, recurrent = module.conv1d_state, module.rg_lru.recurrent_states
    module.conv1d_state = module.rg_lru.recurrent_states = None
    if conv is not None and recurrent is not None:  # (use_cache=False keeps none)
        states.conv_states[0], states.recurrent_states[0] = conv, recurrent


BINDINGS: dict[str, Binding] = {
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock": Binding(
        "recurrent_gemma", "past_key_values", _recurrent_gemma_load, _recurrent_gemma_store, positions=True),
}


def binding(cls: type) -> Binding | None:
    """The state binding of exactly `cls` (None: none)."""
    return BINDINGS.get(_qualname(cls))


def layer_index(name: str, module: torch.nn.Module) -> int | None:
    """A bound mixer's layer: its `layer_idx` / `layer_id`, else the last index in its module path
    (``model.layers.3.temporal_block``: 3)."""
    for attr in ("layer_idx", "layer_id"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    found = re.findall(r"\.(\d+)(?:\.|$)", name)
    return int(found[-1]) if found else None
