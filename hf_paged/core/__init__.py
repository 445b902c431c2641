"""Pure-Python bookkeeping, no torch: which physical KV block holds which token, and which tokens run each step.

Bottom layer of hf_paged (see docs/architecture.md): `block_pool` (free list, ref counts, prefix-cache index),
`block_manager` (per-sequence block tables: fork, append with copy-on-write, truncate, free; mixins
`prefix_caching`, `swapping` and `window`), `layer_groups` and `block_groups` (one table per layer group of a mixed
sliding / full stack: `GroupedBlockManager`), `sequence` (request and sequence state) and `scheduler` (FCFS
iteration-level scheduling with a token budget, chunked prefill and preemption). Everything above may import this
package; it imports nothing of hf_paged.
"""

from .block_groups import GroupedBlockManager
from .block_manager import NULL_BLOCK, BlockManager
from .block_pool import BlockAllocator, CachingBlockAllocator, NoFreeBlocksError, hash_block
from .block_stats import AppendResult, BlockStats, PrefixCacheStats, PrefixMatch
from .layer_groups import LayerGroups, plan_layer_groups
from .schedule import ScheduledSeq, SchedulerOutput
from .scheduler import Scheduler
from .sequence import Sequence, SequenceGroup, SequenceStatus
from .state_slots import NoFreeSlotsError, SlotOps, StateSlots

__all__ = [
    "AppendResult",
    "BlockAllocator",
    "BlockManager",
    "BlockStats",
    "CachingBlockAllocator",
    "GroupedBlockManager",
    "LayerGroups",
    "NULL_BLOCK",
    "NoFreeBlocksError",
    "NoFreeSlotsError",
    "PrefixCacheStats",
    "PrefixMatch",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
    "SlotOps",
    "StateSlots",
    "hash_block",
    "plan_layer_groups",
]
