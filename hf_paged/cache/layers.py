"""`PagedLayer`: the per-layer facade of a `PagedCache` in transformers' `Cache.layers` list.

transformers' generic `Cache` code asks its layers (is_sliding, is_compileable, mask sizes, batch size, ...); each
answers for the whole paged cache, whose pool holds every layer's blocks.
"""

from __future__ import annotations

import weakref

from transformers.cache_utils import CacheLayerMixin

__all__ = ["PagedLayer", "window_bound"]


def window_bound(windows: dict[int, int | None], num_kv_layers: int) -> tuple[bool, int | None]:
    """``(known, window)`` of a cache whose K/V layers' attention calls passed `windows` (layer -> sliding window or
    None): whether every layer was seen, and then the largest window when every layer slides (None when some layer
    attends everything).

    Why from the calls rather than the config: the window a layer's kernels apply is exactly the ``sliding_window``
    transformers passes to the attention function (models read it from their config in different ways, e.g. Qwen2's
    ``layer_types``); keys older than the largest of them are read by no layer.
    """
    if len(windows) < num_kv_layers:
        return False, None
    if not windows:  # no K/V layer (a pure recurrent model): nothing to release, its blocks cost nothing
        return True, None
    if any(w is None for w in windows.values()):
        return True, None
    return True, max(windows.values())


class PagedLayer(CacheLayerMixin):
    """Per-layer facade so `Cache`'s generic properties (is_sliding, is_compileable, ...) answer correctly."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache, layer_idx: int):
        super().__init__()
        self._cache = weakref.proxy(cache)  # no cache <-> layer cycle: dropping the cache frees the pool at once
        self._layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states):  # the pool is allocated by the cache
        self._cache._ensure_pool(key_states.device, key_states.dtype, key_states.shape[1], layer_idx=self._layer_idx)

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self._layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        # the class's own method: RecurrentGemma's model rebinds its cache's `get_seq_length` (and `get_mask_sizes`)
        # to ask its first attention layer, which would ask the rebound method back, forever
        return self._cache.__class__.get_seq_length(self._cache)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass

    @property
    def batch_size(self) -> int:
        return len(self._cache._rows)
