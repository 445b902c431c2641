"""Moved to `hf_paged.core`; `hf_paged.block_manager` stays as a thin re-export for code written against 0.1 (no logic here)."""

from .core.block_manager import BlockManager
from .core.block_pool import ROOT_ENTRY, ROOT_KEY, BlockAllocator, CachingBlockAllocator, NoFreeBlocksError, hash_block  # noqa: F401
from .core.block_stats import AppendResult, BlockStats, PrefixCacheStats, PrefixMatch

__all__ = ["AppendResult", "BlockAllocator", "BlockManager", "BlockStats", "CachingBlockAllocator", "NoFreeBlocksError", "PrefixCacheStats", "PrefixMatch", "hash_block"]
