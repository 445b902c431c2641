"""The KV pool as a transformers `Cache`: `PagedCache` (drop-in for `DynamicCache`, and the engine's pool), the
per-forward `StepMetadata`, the memory arithmetic that sizes a pool, and an FP8 pool's scales (`kv_quant`).

Layer 3 of hf_paged (docs/architecture.md): imports `hf_paged.core` and `hf_paged.kernels`; imported by the
attention functions, the runner, the engine and the integrations.
"""

from .grouped_cache import GroupedPagedCache, fill_group_slots, plan_for
from .kv_pages import KVPages
from .kv_pool import KVPool, KVShape
from .kv_quant import KV_CACHE_DTYPES, KVScales, checkpoint_kv_scales, resolve_kv_cache_dtype
from .memory import (
    BLOCKLESS_POOL_BLOCKS,
    attention_heads,
    attention_shape,
    kv_bytes_per_token,
    kv_layer_indices,
    latent_kv_width,
    layer_kv_shapes,
    memory_fraction,
    parse_memory,
)
from .paged_cache import CacheFullError, PagedCache, device_table
from .state_pool import StateKey, StatePool, StateSpec
from .step import StepMetadata

__all__ = ["BLOCKLESS_POOL_BLOCKS", "CacheFullError", "GroupedPagedCache", "fill_group_slots", "plan_for", "KVPages", "KVPool", "KVScales", "KVShape", "KV_CACHE_DTYPES", "PagedCache", "StateKey", "StatePool", "StateSpec",
           "StepMetadata", "attention_heads", "attention_shape", "checkpoint_kv_scales", "device_table",
           "kv_bytes_per_token", "kv_layer_indices", "latent_kv_width", "layer_kv_shapes", "memory_fraction",
           "parse_memory", "resolve_kv_cache_dtype"]
