"""Value objects the block manager returns: prefix matches, append results, pool and prefix-cache statistics.

Frozen dataclasses, pure Python; read by the scheduler, the engine's statistics and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AppendResult", "BlockStats", "PrefixCacheStats", "PrefixMatch", "pool_stats"]


@dataclass(frozen=True)
class PrefixMatch:
    """What :meth:`BlockManager.match_prefix` found for a token sequence (pure: nothing is reserved).

    ``blocks`` are the cached blocks a sequence admitted now would map (whole blocks, verified); ``num_cached_tokens``
    of its tokens need no computation (always ``< num_tokens`` so that the last token is computed, and a multiple of
    the block size). ``pending`` says that the next block after the match is being computed by a resident sequence
    right now (waiting a step for it would give a longer hit).
    """

    num_tokens: int
    num_cached_tokens: int = 0
    blocks: tuple[int, ...] = ()
    entries: tuple[int, ...] = ()  # cache entry ids of ``blocks``
    keys: tuple[int, ...] = ()  # chain keys of every full block of the tokens
    num_hit_blocks: int = 0  # verified cached blocks, before keeping the last token uncached
    pending: bool = False
    # recurrent state (hybrid models): the checkpoint restored with the mapped blocks (the entry id of the last one),
    # None when nothing is mapped; the match is cut to the last block whose state was checkpointed
    state_key: int | None = None
    salt: int = 0  # the keys chain from `block_pool.salted_root(salt)` (a LoRA adapter's id; 0: none)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters of a :class:`BlockManager` (all zero when caching is off)."""

    enabled: bool
    queries: int  # sequences admitted through allocate_prefix
    query_tokens: int  # tokens those sequences had (prompt, or prompt + output on recompute)
    hit_tokens: int  # tokens served from the cache: prefill tokens saved
    cached_blocks: int  # blocks holding an entry (in use or evictable)
    evictable_blocks: int  # cached blocks with ref count 0 (counted as free)
    evictions: int  # cached blocks reallocated for other content

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / query_tokens`` (0 when nothing was looked up)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True)
class BlockStats:
    """A snapshot of GPU pool usage, for metrics and the fragmentation/sharing numbers of the paper (§6, Fig. 2).

    Only resident (GPU) tables count; the ``cpu_*`` fields describe the swap pool.
    """

    num_blocks: int
    used_blocks: int
    free_blocks: int
    shared_blocks: int  # ref count > 1
    logical_blocks: int  # blocks held by GPU tables, summed: what would be used without sharing (released excluded)
    allocated_slots: int  # used_blocks * block_size
    used_slots: int  # slots holding a token, counted once per physical block
    waste_slots: int  # allocated_slots - used_slots (internal fragmentation)
    cpu_blocks: int = 0
    cpu_used_blocks: int = 0
    cpu_free_blocks: int = 0
    cached_blocks: int = 0  # prefix cache: evictable blocks (ref count 0, entry kept), included in free_blocks
    prefix_query_tokens: int = 0  # prefix cache: tokens looked up at admission
    prefix_hit_tokens: int = 0  # prefix cache: tokens served from the cache (prefill tokens saved)
    released_blocks: int = 0  # sliding window: table entries of resident sequences released now (hold no block)
    window_released: int = 0  # sliding window: table entries released so far (BlockManager.release_before)
    state_slots: int = 0  # hybrid models: recurrent-state slots for sequences (0: the model keeps no such state)
    state_slots_used: int = 0  # held by resident sequences now
    state_cpu_slots_used: int = 0  # held by swapped-out sequences
    state_checkpoints: int = 0  # checkpoint slots (prefix caching of recurrent states)
    state_checkpoints_used: int = 0

    @property
    def waste_fraction(self) -> float:
        """Share of allocated slots holding no token (0 when nothing is allocated)."""
        return self.waste_slots / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def sharing_saving(self) -> float:
        """Share of logical blocks that sharing saved: ``1 - used / logical`` (0 when there are no tables)."""
        return 1.0 - self.used_blocks / self.logical_blocks if self.logical_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Prefix cache: ``prefix_hit_tokens / prefix_query_tokens`` (0 when nothing was looked up)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(frozen=True)
class AppendResult:
    """What :meth:`BlockManager.append_slots` reserved.

    ``copies`` must be performed *before* the new tokens are written: the copied block holds the tokens that precede
    them in the same block.
    """

    slots: list[int]  # physical slot = block_id * block_size + offset, one per new token, in order
    copies: list[tuple[int, int]]  # (src_block, dst_block) copy-on-write pairs
    # `append_decode_slots`: positions (in its `seq_ids`) of the tables that changed, by a new block or a copy-on-write
    changed: list[int] | None = None


def pool_stats(manager) -> BlockStats:
    """`BlockManager.stats()`: usage of `manager`'s GPU pool, O(live tables).

    ``used_slots`` counts each physical block once, as full unless every table holding it sees it as its partial
    last block, in which case it holds as many tokens as the longest of those views. (After a truncate into a
    shared block, holders can disagree on how much of it is filled; the tokens of the longest view are live.)
    """
    gpu, mask, bs = manager.gpu, manager._mask, manager.block_size
    logical = released = 0
    partial: dict[int, list[int]] = {}  # last block -> [tables seeing it partial, longest partial view]
    for seq in manager._seqs.values():
        if seq.swapped:
            continue
        logical += seq.num_held
        released += seq.released
        filled = seq.num_tokens & mask
        if filled:
            entry = partial.get(seq.table[-1])
            if entry is None:
                partial[seq.table[-1]] = [1, filled]
            else:
                entry[0] += 1
                entry[1] = max(entry[1], filled)
    used_blocks = gpu.num_used
    allocated = used_blocks * bs
    empty = sum(bs - longest for block, (holders, longest) in partial.items() if holders == gpu.ref_count(block))
    used_slots = allocated - empty
    return BlockStats(
        num_blocks=manager.num_blocks,
        used_blocks=used_blocks,
        free_blocks=gpu.num_free,
        shared_blocks=gpu.num_shared,
        logical_blocks=logical,
        allocated_slots=allocated,
        used_slots=used_slots,
        waste_slots=allocated - used_slots,
        cpu_blocks=manager.num_cpu_blocks,
        cpu_used_blocks=manager.cpu.num_used,
        cpu_free_blocks=manager.cpu.num_free,
        cached_blocks=getattr(gpu, "num_evictable", 0),
        prefix_query_tokens=manager.prefix_query_tokens,
        prefix_hit_tokens=manager.prefix_hit_tokens,
        released_blocks=released,
        window_released=manager.window_released,
        **_state_stats(manager.state),
    )


def _state_stats(state) -> dict:
    """The recurrent-state fields of `BlockStats` (a hybrid model's slots; none otherwise)."""
    if state is None:
        return {}
    return dict(state_slots=state.num_slots, state_slots_used=state.num_used,
                state_cpu_slots_used=state.num_cpu_slots - state.num_cpu_free,
                state_checkpoints=state.num_checkpoints, state_checkpoints_used=state.num_checkpoints_used)
