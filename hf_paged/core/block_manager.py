"""Block bookkeeping for the paged KV cache (PagedAttention paper §4.2-4.5).

This module only decides *which* physical block holds *which* token; it never touches tensors. That is deliberate:
the scheduler needs to ask "does this fit?" many times per step, tests need to exercise thousands of random
operation sequences in seconds, and other projects can reuse the logic. Hence: pure Python, no torch import.

Vocabulary
----------
* A *block* is a fixed group of ``block_size`` KV slots. Physical slot of token ``p`` of a sequence is
  ``table[p // block_size] * block_size + p % block_size`` (the pool layout of :mod:`hf_paged.kernels`).
* A *block table* maps a sequence's logical blocks to physical block ids, in order. Its length is always
  ``ceil(num_tokens / block_size)``: blocks are reserved lazily, one at a time, so a sequence wastes at most the
  unfilled tail of its last block (§4.3).
* Blocks are reference counted so that forked sequences (parallel sampling, beam search, §4.4) share their common
  prefix. A block is written only while exactly one table holds it; a shared *partial* last block is first copied
  (copy-on-write). A shared *full* block is never written again, so it is never copied.
* Swapping (§4.5) moves a whole sequence group to a CPU pool and back, keeping the sharing inside the group.
* Sliding windows (mixin `SlidingWindow`, :meth:`BlockManager.release_before`): when every attention layer of the
  model slides, the blocks wholly before the oldest key any future query attends are released: their table entries
  become :data:`NULL_BLOCK` (tables keep their length, so positions still index them) and their references go back to
  the pool. Released entries are always a prefix of the table; every operation skips them (fork, free, truncate, swap,
  statistics). A shared block (fork, prefix-cache hit) only returns to the pool when its last holder releases it; a
  keyed block stays cached (evictable), as when its sequence finishes.

Automatic prefix caching (§4.4 "shared prefix", off unless ``enable_prefix_caching=True``)
-----------------------------------------------------------------------------------------
* Every *full* block whose KV has been written is keyed by :func:`hash_block` (xxhash64) of its token ids chained
  with the key of the block before it, so equal tokens after different prefixes get different keys. The caller tells
  the manager which tokens are computed: :meth:`BlockManager.commit` after a forward. The partial last block is never
  keyed, hence never shared through the cache.
* A key is only an index. Every keyed block is a cache *entry* with a unique id that records its tokens and the entry
  id of its parent block; a lookup hits only if both match what the asking sequence has (its tokens and the entry it
  matched one block earlier). So a hit's KV was computed from exactly the asking sequence's prefix, even under a hash
  collision (forced in the tests by patching :func:`hash_block` to a constant).
* :meth:`BlockManager.allocate_prefix` maps the longest cached whole-block prefix of a new sequence by reference and
  returns how many tokens need no computation. At least one token must be computed (for the logits), so when the
  whole prompt is cached the last block is *not* mapped and is recomputed: mapped blocks are always full and never
  written again (no copy-on-write of cache entries at admission).
* A keyed block is never written in place: a write into it (possible only after :meth:`truncate` cut into it) copies
  it when shared and otherwise first removes it from the cache.
* A block whose ref count drops to 0 keeps its entry in an evictable LRU pool (the tail blocks of a sequence are
  released first, so they are evicted before its prefix). ``num_free`` counts evictable blocks as available;
  allocation takes truly free blocks first, then evicts the least recently released cached block.
* Swapping: the GPU original of a swapped-out keyed block keeps its entry (evictable until a new request hits it);
  CPU blocks carry no keys; swap-in copies every block into fresh, unkeyed GPU blocks.

The manager returns the copies the caller must perform (copy-on-write and swap pairs) instead of doing them, so the
tensor side can batch every copy of a step into one kernel launch (``hf_paged.kernels.copy_blocks``): the scheduler
collects a step's pairs (copy-on-write is done by ``append_slots`` of the sequence that writes into the shared partial
block), and the model runner applies them before the forward.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from .block_pool import BlockAllocator, CachingBlockAllocator, NoFreeBlocksError, _as_int
from .block_stats import AppendResult, BlockStats, pool_stats
from .prefix_caching import PrefixCaching
from .seq_blocks import NULL_BLOCK, _Seq
from .state_slots import NoFreeSlotsError, StateSlots
from .swapping import Swapping
from .window import SlidingWindow

__all__ = ["BlockManager", "NULL_BLOCK", "NoFreeSlotsError", "StateSlots"]


class BlockManager(PrefixCaching, Swapping, SlidingWindow):
    """Block tables of every sequence over one GPU pool and one CPU swap pool.

    Why one class of this size: every table operation (allocate, fork, append with copy-on-write, the batched decode
    append, truncate, free) must update the same state together (tables, ref counts, the logical-block counter, the
    prefix cache's pending keys) to keep the invariants below; prefix caching, swapping and the sliding-window
    release, which only build on them, are the mixins `PrefixCaching`, `Swapping` and `SlidingWindow`.

    Invariants (checked by the property tests):

    * ``len(table) == blocks_for(num_tokens)`` and no block id appears twice in one table;
    * every block's ref count equals the number of tables (on its device) holding it;
    * a slot returned for writing belongs to a block held by exactly one table (copy-on-write protects sharers);
    * every operation that raises leaves the state unchanged.

    Cost: every operation is O(blocks it touches) (plus the group size for swaps); :meth:`stats` is O(live tables).
    """

    def __init__(
        self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, *, enable_prefix_caching: bool = False,
        state: StateSlots | None = None,
    ) -> None:
        try:
            size = _as_int("block_size", block_size, 1)
        except ValueError:
            size = 0
        if size < 1 or size & (size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {block_size!r}")
        self.block_size: int = size
        self.num_blocks: int = _as_int("num_blocks", num_blocks, 1)
        self.num_cpu_blocks: int = _as_int("num_cpu_blocks", num_cpu_blocks, 0)
        # Power-of-two block size: token -> (block index, offset) is a shift and a mask.
        self._shift = size.bit_length() - 1
        self._mask = size - 1
        self.cpu = BlockAllocator(self.num_cpu_blocks)
        self._seqs: dict[Hashable, _Seq] = {}
        self.enable_prefix_caching = False
        self.gpu: BlockAllocator = BlockAllocator(self.num_blocks)
        self._pending: dict[int, int] = {}  # chain key of a block still to be computed -> resident holders
        self._num_logical = 0  # blocks held by resident tables (released entries excluded), kept by every operation
        self.window_released = 0  # blocks released out of the sliding window so far (release_before)
        self.prefix_queries = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        # recurrent state slots (hybrid models): every sequence with a table also holds a slot, which follows it
        # through allocate, fork, free and swaps; prefix hits are cut to a block whose state was checkpointed
        self.state: StateSlots | None = state
        self.set_prefix_caching(enable_prefix_caching)

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_cpu_blocks={self.num_cpu_blocks}, seqs={len(self._seqs)}, gpu_free={self.gpu.num_free}, "
            f"prefix_caching={self.enable_prefix_caching})"
        )

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn automatic prefix caching on or off; only while no sequence exists (cached content is dropped)."""
        if not isinstance(enabled, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {enabled!r}")
        if enabled == self.enable_prefix_caching:
            return
        if self._seqs:
            raise ValueError("cannot switch prefix caching while sequences hold blocks; free them first")
        self.enable_prefix_caching = enabled
        self.gpu = (CachingBlockAllocator if enabled else BlockAllocator)(self.num_blocks)
        self._pending.clear()

    def grow(self, num_blocks: int) -> None:
        """More GPU blocks (`PagedCache` growing on demand): new ids after the existing ones; tables are untouched."""
        self.gpu.grow(num_blocks)
        self.num_blocks = self.gpu.num_blocks

    # ------------------------------------------------------------------ helpers

    def _get(self, seq_id: Hashable, name: str = "seq_id") -> _Seq:
        """The state of a known sequence; unknown ids raise ValueError naming the argument (``name``)."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"{name} {seq_id!r} is unknown") from None
        except TypeError:  # unhashable
            raise ValueError(f"{name} {seq_id!r} is unknown (unhashable)") from None

    def _get_resident(self, seq_id: Hashable, action: str, name: str = "seq_id") -> _Seq:
        seq = self._get(seq_id, name)
        if seq.swapped:
            raise ValueError(f"{name} {seq_id!r} is swapped out; swap it in before {action}")
        return seq

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Physical slots of positions ``[start, end)`` of a sequence with block table `table`.

        A range longer than two blocks (a prefill chunk: up to the token budget, 16k slots) is built block by block
        from `range`s, about twice as fast as a comprehension over its positions: the scheduler plans a prefill step
        while the GPU waits for it."""
        shift, mask = self._shift, self._mask
        if end - start <= 2 << shift:
            return [(table[p >> shift] << shift) | (p & mask) for p in range(start, end)]
        out: list[int] = []
        extend = out.extend
        p = start
        while p < end:
            i = p >> shift
            base = table[i] << shift
            stop = min(end, (i + 1) << shift)
            extend(range(base | (p & mask), base + stop - (i << shift)))
            p = stop
        return out

    def _append_plan(self, seq: _Seq, num_new_tokens: int, allocator: BlockAllocator | None = None) -> tuple[bool, int]:
        """(copy-on-write needed, new blocks needed) to append ``num_new_tokens`` tokens to a sequence.

        ``allocator`` holds the ref counts of the sequence's table (the GPU pool unless the table is swapped out).
        """
        if num_new_tokens == 0:
            return False, 0
        n = seq.num_tokens
        # The last block can only be written in place if this table is its sole holder; a partial last block held
        # by others (fork, or a truncate that cut into a shared block) must be copied first.
        cow = bool(n & self._mask) and (allocator or self.gpu)._ref[seq.table[-1]] > 1
        new_blocks = self.blocks_for(n + num_new_tokens) - len(seq.table)
        return cow, new_blocks


    # ------------------------------------------------------------------ sizing

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        n = _as_int("num_tokens", num_tokens, 0)
        return (n + self._mask) >> self._shift

    def blocks_to_hold(self, num_tokens: int, chunk: int) -> int:
        """Most blocks one sequence of `num_tokens` tokens holds at once, prefilled in chunks of at most `chunk`
        tokens: its whole table (`GroupedBlockManager` says less; what `add_request` checks against the pool)."""
        return self.blocks_for(num_tokens)

    def token_capacity(self, chunk: int) -> int:
        """The longest sequence the whole pool can hold (`blocks_to_hold` within `num_blocks`)."""
        return self.num_blocks << self._shift

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether :meth:`allocate` of ``num_tokens`` tokens would succeed now."""
        return self.blocks_for(num_tokens) <= self.gpu.num_free

    # ------------------------------------------------------------------ lifecycle

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Create the table of a new sequence holding ``num_tokens`` slots (0 allowed); return a copy of it.

        The slots of the tokens are ``slot_mapping(seq_id, 0, num_tokens)``.
        """
        n = _as_int("num_tokens", num_tokens, 0)
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} already exists")
        need = self.blocks_for(n)
        if need > self.gpu.num_free:
            raise NoFreeBlocksError(f"allocating {n} tokens needs {need} blocks, only {self.gpu.num_free} are free")
        if self.state is not None:
            self.state.allocate(seq_id)  # (raises NoFreeSlotsError before anything changed)
        table = self.gpu.allocate_many(need)
        self._seqs[seq_id] = _Seq(table, n)
        self._num_logical += need
        return list(table)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (same tokens); never allocates.

        The shared partial last block (if any) is copied lazily by whichever of the two appends first.
        """
        parent = self._get_resident(parent_id, "forking it", "parent_id")
        if child_id in self._seqs:
            raise ValueError(f"child_id {child_id!r} already exists")
        if self.state is not None:
            self.state.fork(parent_id, child_id)  # a copy of the parent's state (raises NoFreeSlotsError first)
        self.gpu.incref_many(parent.held())
        child = self._seqs[child_id] = _Seq(list(parent.table), parent.num_tokens)
        child.released = parent.released
        self._num_logical += parent.num_held
        if self.enable_prefix_caching:
            child.keys, child.entries, child.committed = list(parent.keys), list(parent.entries), parent.committed
            child.stale, child.salt = parent.stale, parent.salt
            if not child.stale:
                self._add_pending(child.keys, child.committed)

    def blocks_needed_to_append(self, seq_id: Hashable, num_new_tokens: int = 1) -> int:
        """GPU blocks :meth:`append_slots` would take: new blocks plus one if copy-on-write is needed."""
        k = _as_int("num_new_tokens", num_new_tokens, 0)
        cow, new_blocks = self._append_plan(self._get_resident(seq_id, "appending"), k)
        return new_blocks + cow

    def blocks_needed_to_append_many(self, requests: Iterable[tuple[Hashable, int]]) -> int:
        """Exact GPU blocks that :meth:`append_slots` of every ``(seq_id, num_new_tokens)`` would take, in any order.

        Summing :meth:`blocks_needed_to_append` over siblings overcounts: when every holder of a shared partial last
        block appends, the last one to do so finds itself the sole holder and writes in place. A scheduler checking
        a whole sequence group against the free pool should use this so it does not preempt needlessly.
        """
        pairs = []
        for seq_id, num_new_tokens in requests:
            k = _as_int("num_new_tokens", num_new_tokens, 0)
            pairs.append((seq_id, self._get_resident(seq_id, "appending", "requests entry"), k))
        return self._count_appends(pairs, self.gpu)

    def _count_appends(self, pairs: list[tuple[Hashable, _Seq, int]], allocator: BlockAllocator) -> int:
        """Blocks that appending ``k`` tokens to each ``(seq_id, seq, k)`` takes, ref counts read from ``allocator``."""
        total = 0
        seen: set[Hashable] = set()
        cow_holders: dict[int, int] = {}  # shared partial last block -> appending holders
        for seq_id, seq, k in pairs:
            if seq_id in seen:
                raise ValueError(f"requests lists {seq_id!r} twice")
            seen.add(seq_id)
            cow, new_blocks = self._append_plan(seq, k, allocator)
            total += new_blocks
            if cow:
                cow_holders[seq.table[-1]] = cow_holders.get(seq.table[-1], 0) + 1
        for block, holders in cow_holders.items():
            total += holders - 1 if holders == allocator.ref_count(block) else holders
        return total

    def can_append(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        """Whether :meth:`append_slots` would succeed now."""
        return self.blocks_needed_to_append(seq_id, num_new_tokens) <= self.gpu.num_free

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1, *, slots: bool = True) -> AppendResult:
        """Reserve slots for the next ``num_new_tokens`` tokens of a resident sequence.

        If the last block is partial and shared, it is first replaced by a fresh block: ``copies`` gets
        ``(old, new)`` and ``old`` loses this table's reference. All-or-nothing: on :class:`NoFreeBlocksError`
        nothing changes. ``slots=False`` reserves without listing the slots (an empty ``slots``): a caller that
        reads them off the table later (a grouped manager's other groups) skips a list as long as the chunk.
        """
        k = _as_int("num_new_tokens", num_new_tokens, 0)
        seq = self._get_resident(seq_id, "appending")
        cow, new_blocks = self._append_plan(seq, k)
        if new_blocks + cow > self.gpu.num_free:
            raise NoFreeBlocksError(
                f"appending {k} tokens to seq_id {seq_id!r} needs {new_blocks + cow} blocks, "
                f"only {self.gpu.num_free} are free"
            )
        table = seq.table
        copies: list[tuple[int, int]] = []
        if cow:
            old = table[-1]
            new = self.gpu.allocate()
            self.gpu.decref(old)  # cannot reach 0: it was shared
            table[-1] = new
            copies.append((old, new))
        elif k and seq.num_tokens & self._mask and self.enable_prefix_caching and self.gpu.is_cached(table[-1]):
            # sole holder of a cached block it cut into (truncate): the cache must not see it change
            self.gpu.uncache(table[-1])
        if new_blocks:
            table.extend(self.gpu.allocate_many(new_blocks))
        self._num_logical += new_blocks
        start = seq.num_tokens
        seq.num_tokens = start + k
        return AppendResult(slots=self._slots(table, start, start + k) if slots else [], copies=copies)

    def append_decode_slots(
        self,
        seq_ids: Sequence[Hashable],
        token_ids: Sequence[Sequence[int]] | None = None,
        num_computed: Sequence[int] | None = None,
    ) -> AppendResult | None:
        """One decode step of many sequences at once: reserve the next slot of each, all or nothing.

        The hot path of a continuous-batching step: the same slots and copy-on-write pairs as ``append_slots(seq_id,
        1)`` for every sequence in order (siblings sharing a partial last block copy it, the last of them writes in
        place), at a fraction of the cost. Returns one slot per sequence and the copies, or None, with nothing
        reserved, when the pool cannot hold every new block or some sequence would write into a cached block (after
        a truncate); the caller then takes the per-sequence path, which preempts as needed.

        With prefix caching, ``token_ids[i]`` / ``num_computed[i]`` of each sequence are committed first (the blocks
        the previous forward filled get their keys, as :meth:`commit` does); that happens even when None is returned
        (committing is idempotent).
        """
        seqs, mask, gpu = self._seqs, self._mask, self.gpu
        caching = self.enable_prefix_caching
        if caching and (token_ids is None or num_computed is None):
            raise ValueError("token_ids and num_computed are required with prefix caching")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids lists a sequence twice")
        if not caching and len(seq_ids) <= gpu.num_free:
            # each sequence takes at most one block (a new one or a copy-on-write): it all fits, no planning pass
            states = [seqs.get(seq_id) for seq_id in seq_ids]
            if None not in states and not any(seq.swapped for seq in states):
                return self._append_one_each(states)
        states = []
        need = 0
        cow_holders: dict[int, int] = {}  # shared partial last block -> appending holders
        refs = gpu._ref
        entry_of = gpu._entry_of if caching else None  # type: ignore[attr-defined]
        shift = self._shift
        for index, seq_id in enumerate(seq_ids):
            seq = seqs.get(seq_id)
            if seq is None or seq.swapped:
                self._get_resident(seq_id, "appending", "seq_ids entry")  # raises the documented ValueError
            if caching and (num_computed[index] >> shift) > seq.committed:  # type: ignore[index]
                self.commit(seq_id, token_ids[index], num_computed[index])  # type: ignore[index]
            n = seq.num_tokens
            if n & mask:
                last = seq.table[-1]
                if entry_of is not None and entry_of[last] is not None:
                    return None
                if refs[last] > 1:
                    cow_holders[last] = cow_holders.get(last, 0) + 1
            else:
                need += 1
            states.append(seq)
        for block, holders in cow_holders.items():
            need += holders - 1 if holders == refs[block] else holders
        if need > gpu.num_free:
            return None
        return self._append_one_each(states)

    def _append_one_each(self, states: list[_Seq]) -> AppendResult:
        """`append_decode_slots` once it is known to fit: one slot each, new blocks and copy-on-writes as needed."""
        mask, shift, gpu = self._mask, self._shift, self.gpu
        refs = gpu._ref
        allocate = gpu.allocate
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        changed: list[int] = []
        for index, seq in enumerate(states):
            n = seq.num_tokens
            table = seq.table
            if not n & mask:
                table.append(allocate())
                changed.append(index)
            elif refs[table[-1]] > 1:  # shared partial last block: copy it (the last holder finds ref 1: in place)
                old = table[-1]
                new = allocate()
                refs[old] -= 1
                if refs[old] == 1:
                    gpu._num_shared -= 1
                table[-1] = new
                copies.append((old, new))
                changed.append(index)
            slots.append((table[-1] << shift) | (n & mask))
            seq.num_tokens = n + 1
        self._num_logical += len(changed) - len(copies)  # the new blocks
        return AppendResult(slots=slots, copies=copies, changed=changed)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens and release the blocks past them (cache cropping).

        Works on either device. If the new last block is partial and still shared, the next append copies it, so a
        sharer that still uses the cut-off positions is never overwritten.
        """
        seq = self._get(seq_id)
        n = _as_int("num_tokens", num_tokens, 0)
        if n > seq.num_tokens:
            raise ValueError(f"num_tokens must be <= {seq.num_tokens} (the length of seq_id {seq_id!r}), got {n}")
        if n < seq.released << self._shift:  # the K/V there is gone: the sequence could never be extended again
            raise ValueError(f"num_tokens must be >= {seq.released << self._shift}: seq_id {seq_id!r} released the "
                             f"blocks before it (out of the sliding window), got {n}")
        keep = self.blocks_for(n)
        allocator = self.cpu if seq.swapped else self.gpu
        dropped = seq.table[keep:]
        if self.enable_prefix_caching:
            dropped.reverse()  # tail first into the LRU pool: evicted first
        allocator.decref_many(dropped)
        del seq.table[keep:]
        if not seq.swapped:
            self._num_logical -= len(dropped)
        seq.num_tokens = n
        full = n >> self._shift
        if len(seq.keys) > full:
            self._drop_pending(seq.keys, max(seq.committed, full))
            del seq.keys[full:]
            del seq.entries[full:]
            seq.committed = min(seq.committed, full)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence: release its references (on whichever device it lives) and forget its table."""
        seq = self._get(seq_id)
        allocator = self.cpu if seq.swapped else self.gpu
        if self.enable_prefix_caching:
            self._drop_pending(seq.keys, seq.committed)
            allocator.decref_many(seq.held()[::-1])  # tail first into the LRU pool: evicted before the shared prefix
        else:
            allocator.decref_many(seq.held())
        if not seq.swapped:
            self._num_logical -= seq.num_held
        del self._seqs[seq_id]
        if self.state is not None:
            self.state.free(seq_id)

    def reset(self) -> None:
        """Drop every table; every block of both pools becomes free (allocator objects are kept)."""
        if self.state is not None:
            self.state.reset()
        self._seqs.clear()
        self.gpu._reset()
        self.cpu._reset()
        self._pending.clear()
        self._num_logical = 0

    # ------------------------------------------------------------------ queries

    def has_seq(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` has a table (resident or swapped)."""
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    def seq_ids(self) -> list:
        """All known sequence ids, in creation order."""
        return list(self._seqs)

    def table_views(self, seq_ids: Sequence[Hashable]) -> list[list[int]]:
        """`table_view` of each id, in one call (a runner's per-step pass over 256 sequences)."""
        seqs = self._seqs
        try:
            return [seqs[seq_id].table for seq_id in seq_ids]
        except (KeyError, TypeError):
            for seq_id in seq_ids:
                self._get(seq_id, "seq_ids entry")  # raises the documented ValueError
            raise

    def table_view(self, seq_id: Hashable) -> list[int]:
        """The live table itself, not a copy (hot paths): read it, never modify it, and do not keep it across
        operations that may replace it (swaps). Released entries (a prefix) are :data:`NULL_BLOCK`."""
        return self._get(seq_id).table

    def usage(self) -> tuple[int, int]:
        """``(used_blocks, logical_blocks)`` of the GPU pool in O(1): physical blocks in use, and the blocks the
        resident tables would use without sharing (see :meth:`stats`, which also measures fragmentation)."""
        return self.gpu.num_used, self._num_logical

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the table; CPU block ids while the sequence is swapped out (see :meth:`is_swapped`); released
        entries (a prefix, see :meth:`release_before`) are :data:`NULL_BLOCK`."""
        return list(self._get(seq_id).table)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Number of tokens the table holds slots for."""
        return self._get(seq_id).num_tokens

    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether the sequence's blocks live in the CPU pool."""
        return self._get(seq_id).swapped

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Physical GPU slots of tokens ``[start, end)`` of a resident sequence."""
        seq = self._get_resident(seq_id, "asking for its slots")
        s = _as_int("start", start, 0)
        e = _as_int("end", end, 0)
        if e > seq.num_tokens:
            raise ValueError(f"end must be <= {seq.num_tokens} (the length of seq_id {seq_id!r}), got {e}")
        if s > e:
            raise ValueError(f"start must be <= end ({e}), got {s}")
        return self._slots(seq.table, s, e)

    def stats(self) -> BlockStats:
        """Usage of the GPU pool, O(live tables) (`block_stats.pool_stats`)."""
        return pool_stats(self)
