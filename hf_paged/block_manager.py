"""Block bookkeeping for the paged KV cache (PagedAttention paper §4.2-4.5).

This module only decides *which* physical block holds *which* token; it never touches tensors. That is deliberate:
the scheduler needs to ask "does this fit?" many times per step, tests need to exercise thousands of random
operation sequences in seconds, and other projects can reuse the logic. Hence: pure Python, no torch import.

Vocabulary
----------
* A *block* is a fixed group of ``block_size`` KV slots. Physical slot of token ``p`` of a sequence is
  ``table[p // block_size] * block_size + p % block_size`` (the pool layout of ``docs/architecture.md``).
* A *block table* maps a sequence's logical blocks to physical block ids, in order. Its length is always
  ``ceil(num_tokens / block_size)``: blocks are reserved lazily, one at a time, so a sequence wastes at most the
  unfilled tail of its last block (§4.3).
* Blocks are reference counted so that forked sequences (parallel sampling, beam search, §4.4) share their common
  prefix. A block is written only while exactly one table holds it; a shared *partial* last block is first copied
  (copy-on-write). A shared *full* block is never written again, so it is never copied.
* Swapping (§4.5) moves a whole sequence group to a CPU pool and back, keeping the sharing inside the group.

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
tensor side can batch every copy of a step into one kernel launch (``hf_paged.kernels.copy_blocks``).
"""

from __future__ import annotations

import operator
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "AppendResult",
    "BlockAllocator",
    "BlockManager",
    "BlockStats",
    "CachingBlockAllocator",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "PrefixMatch",
    "hash_block",
]

ROOT_KEY = 0x9E3779B97F4A7C15  # chain key "before" the first block
ROOT_ENTRY = 0  # parent entry id of a first block; real entry ids start at 1

_digest: Callable[[bytes], int] | None = None


def _load_digest() -> Callable[[bytes], int]:
    """xxhash64 when the ``xxhash`` package is installed, else BLAKE2b cut to 64 bits (stdlib, slower)."""
    global _digest
    try:
        import xxhash

        _digest = xxhash.xxh64_intdigest
    except ImportError:  # pragma: no cover - xxhash is a dependency; the fallback keeps the module importable
        import hashlib

        def _blake(data: bytes) -> int:
            return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

        _digest = _blake
    return _digest


def hash_block(parent_key: int, token_ids: Sequence[int]) -> int:
    """Key of a full block: 64-bit hash of the parent block's key followed by the block's token ids (int64 LE).

    Looked up as a module global on every call, so tests can patch it (e.g. to a constant to force collisions).
    """
    digest = _digest or _load_digest()
    return digest(parent_key.to_bytes(8, "little") + array("q", token_ids).tobytes())


class NoFreeBlocksError(RuntimeError):
    """An allocation could not be satisfied from the free pool.

    Callers are expected to ask ``can_*`` first (the scheduler preempts instead of failing); the error exists so a
    missed check fails loudly and *without* side effects: every operation that raises it leaves all state unchanged.
    """


def _index(value: object) -> int | None:
    """``value`` as an exact int (numpy/torch ints accepted via ``__index__``), or None; bool is not a count."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _as_int(name: str, value: object, minimum: int) -> int:
    """Validate an integer argument, naming it in the ValueError (the documented error for bad counts)."""
    number = _index(value)
    if number is None or number < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return number


class BlockAllocator:
    """Free list + per-block reference counts over block ids ``0..num_blocks-1`` (one device's pool).

    The free list is a LIFO stack: a just-freed block is handed out next, which keeps the working set of a small
    workload compact and makes allocation order deterministic (a fresh allocator hands out 0, 1, 2, ...).

    Prefix-cache seam: every block leaves the free pool through :meth:`_take_free_block` and returns to it through
    :meth:`_release_block`. A prefix cache would keep released blocks that carry a content key in an evictable pool
    (ref count 0, content still valid), let ``_take_free_block`` evict from it when the plain free list is empty, and
    count evictable blocks in :attr:`num_free`. Nothing else needs to change.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks: int = _as_int("num_blocks", num_blocks, 0)
        self._reset()

    def _reset(self) -> None:
        """Forget every reference: all blocks free, in the initial allocation order."""
        self._ref: list[int] = [0] * self.num_blocks
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._num_shared = 0  # blocks with ref count > 1, kept incrementally so stats never scan the pool

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, num_free={self.num_free}, num_shared={self.num_shared})"

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated right now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with ref count >= 1."""
        return self.num_blocks - self.num_free

    @property
    def num_shared(self) -> int:
        """Blocks with ref count > 1 (held by more than one table)."""
        return self._num_shared

    def free_blocks(self) -> list[int]:
        """A copy of the free list, next-to-be-allocated last (for debugging and invariant checks)."""
        return list(self._free)

    def _check_block(self, block: int) -> int:
        index = _index(block)
        if index is None or not 0 <= index < self.num_blocks:
            raise ValueError(f"block must be an int in [0, {self.num_blocks}), got {block!r}")
        return index

    def _take_free_block(self) -> int:
        """Remove one block from the free pool (the single allocation path; see the class docstring)."""
        return self._free.pop()

    def _release_block(self, block: int) -> None:
        """Return a block whose ref count reached 0 to the free pool (the single release path)."""
        self._free.append(block)

    def allocate(self) -> int:
        """Take a free block and give it ref count 1."""
        if not self.num_free:
            raise NoFreeBlocksError(f"no free block left (num_blocks={self.num_blocks})")
        block = self._take_free_block()
        self._ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a reference to a block in use (a new table shares it). Sharing a free block is a bug."""
        index = self._check_block(block)
        count = self._ref[index]
        if count == 0:
            raise ValueError(f"block {index} is free; cannot incref it")
        if count == 1:
            self._num_shared += 1
        self._ref[index] = count + 1

    def decref(self, block: int) -> bool:
        """Drop a reference; return True when the block became free. Double free raises instead of corrupting."""
        index = self._check_block(block)
        count = self._ref[index]
        if count == 0:
            raise ValueError(f"block {index} is already free; cannot decref it")
        count -= 1
        self._ref[index] = count
        if count == 1:
            self._num_shared -= 1
        elif count == 0:
            self._release_block(index)
            return True
        return False

    def incref_many(self, blocks: list[int]) -> None:
        """:meth:`incref` of every block of a table (in use by construction): the hot loop of a fork, unchecked."""
        refs = self._ref
        for block in blocks:
            count = refs[block]
            if count == 1:
                self._num_shared += 1
            refs[block] = count + 1

    def decref_many(self, blocks: list[int]) -> None:
        """:meth:`decref` of every block of a table, in order: the hot loop of a free, unchecked."""
        refs, release = self._ref, self._release_block
        for block in blocks:
            count = refs[block] - 1
            refs[block] = count
            if count == 1:
                self._num_shared -= 1
            elif count == 0:
                release(block)

    def ref_count(self, block: int) -> int:
        """Number of tables holding the block (0 when free)."""
        return self._ref[self._check_block(block)]

    def is_free(self, block: int) -> bool:
        """Whether the block is in the free pool (ref count 0; with a prefix cache: free or evictable)."""
        return self._ref[self._check_block(block)] == 0

    def is_cached(self, block: int) -> bool:
        """Whether the block holds a prefix-cache entry (never, without a prefix cache)."""
        return False


class _Entry:
    """A prefix-cache entry: the content of one full block (its tokens after the prefix of entry ``parent``)."""

    __slots__ = ("block", "id", "key", "parent", "tokens")

    def __init__(self, entry_id: int, key: int, parent: int, tokens: tuple[int, ...], block: int) -> None:
        self.id = entry_id
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.block = block


class CachingBlockAllocator(BlockAllocator):
    """A :class:`BlockAllocator` whose released keyed blocks stay cached in an evictable LRU pool.

    Three disjoint pools: truly free (``free_blocks()``), used (ref count >= 1) and evictable (ref count 0 with a
    cache entry, ``evictable_blocks()``, least recently released first). ``num_free`` counts free + evictable: both
    can be allocated, truly free blocks first, then the least recently released evictable block (its entry is
    dropped). A cached block can be taken back by reference (:meth:`acquire`) while it is evictable or in use.
    """

    def _reset(self) -> None:
        super()._reset()
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recently released first
        self._by_key: dict[int, _Entry] = {}
        self._entry_of: list[_Entry | None] = [None] * self.num_blocks
        self._next_entry = ROOT_ENTRY + 1
        self.num_evictions = 0

    def __repr__(self) -> str:
        return (
            f"CachingBlockAllocator(num_blocks={self.num_blocks}, num_free={self.num_free}, "
            f"num_evictable={self.num_evictable}, num_cached={self.num_cached}, num_shared={self.num_shared})"
        )

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated right now: truly free plus evictable."""
        return len(self._free) + len(self._lru)

    @property
    def num_evictable(self) -> int:
        """Cached blocks with ref count 0 (counted in :attr:`num_free`)."""
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks holding a cache entry (in use or evictable)."""
        return len(self._by_key)

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, next-to-be-evicted first."""
        return list(self._lru)

    def is_cached(self, block: int) -> bool:
        return self._entry_of[self._check_block(block)] is not None

    def _take_free_block(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._lru.popitem(last=False)
        self._forget(block)
        self.num_evictions += 1
        return block

    def _release_block(self, block: int) -> None:
        if self._entry_of[block] is not None:
            self._lru[block] = None  # most recently released: evicted last
        else:
            self._free.append(block)

    def _forget(self, block: int) -> None:
        """Drop the entry of ``block`` (its content stays where it is; only the index forgets it)."""
        entry = self._entry_of[block]
        if entry is not None:
            self._entry_of[block] = None
            if self._by_key.get(entry.key) is entry:
                del self._by_key[entry.key]

    # ------------------------------------------------------------------ cache operations

    def lookup(self, key: int, parent: int, tokens: tuple[int, ...]) -> _Entry | None:
        """The entry under ``key`` if it holds exactly ``tokens`` after entry ``parent`` (a verified hit), else None."""
        entry = self._by_key.get(key)
        if entry is None or entry.parent != parent or entry.tokens != tokens:
            return None
        return entry

    def entry_id(self, block: int) -> int | None:
        """Entry id held by ``block`` (None when it holds none)."""
        entry = self._entry_of[block]
        return None if entry is None else entry.id

    def acquire(self, block: int) -> None:
        """Take a reference to a cached block: out of the evictable pool at ref count 0, else one more sharer."""
        if self._entry_of[block] is None:
            raise ValueError(f"block {block} holds no cache entry; cannot acquire it")
        if self._ref[block] == 0:
            del self._lru[block]
            self._ref[block] = 1
        else:
            self.incref(block)

    def register(self, block: int, key: int, parent: int, tokens: tuple[int, ...]) -> int | None:
        """Key a full, written, referenced block; return the entry id now describing its content, or None.

        If an entry with the same key already describes the same content (another copy, or this very block), its id
        is returned and ``block`` stays unkeyed. A key held by different content (a hash collision) is taken over
        only if that entry is evictable; otherwise None: this content is not cached (never wrongly shared).
        """
        if self._ref[block] == 0:
            raise ValueError(f"block {block} is not in use; only a written block can be keyed")
        entry = self._by_key.get(key)
        if entry is not None:
            if entry.parent == parent and entry.tokens == tokens:
                return entry.id
            if self._ref[entry.block] > 0:
                return None
            # collision with an evictable entry: drop it, its block becomes truly free
            old = entry.block
            self._forget(old)
            del self._lru[old]
            self._free.append(old)
        if self._entry_of[block] is not None:
            return None  # already describes other content (cannot happen when keyed blocks are never rewritten)
        entry = _Entry(self._next_entry, key, parent, tokens, block)
        self._next_entry += 1
        self._by_key[key] = entry
        self._entry_of[block] = entry
        return entry.id

    def uncache(self, block: int) -> None:
        """Remove the entry of a block in use (about to be written in place by its sole holder)."""
        if self._ref[block] == 0:
            raise ValueError(f"block {block} is not in use; cannot uncache it")
        self._forget(block)


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
    logical_blocks: int  # sum of len(table) over GPU tables: blocks that would be used without sharing
    allocated_slots: int  # used_blocks * block_size
    used_slots: int  # slots holding a token, counted once per physical block
    waste_slots: int  # allocated_slots - used_slots (internal fragmentation)
    cpu_blocks: int = 0
    cpu_used_blocks: int = 0
    cpu_free_blocks: int = 0
    cached_blocks: int = 0  # prefix cache: evictable blocks (ref count 0, entry kept), included in free_blocks
    prefix_query_tokens: int = 0  # prefix cache: tokens looked up at admission
    prefix_hit_tokens: int = 0  # prefix cache: tokens served from the cache (prefill tokens saved)

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


class _Seq:
    """Per-sequence state. ``table`` holds GPU block ids, or CPU block ids while ``swapped``.

    Prefix caching: ``keys`` are the chain keys of the sequence's full blocks known so far (from the tokens given at
    admission, then extended by :meth:`BlockManager.commit`); the first ``committed`` blocks are written and
    ``entries[i]`` is the id of the cache entry describing block ``i``'s content (None after a collision). Keys past
    ``committed`` are *pending*: those blocks are still to be computed.
    """

    __slots__ = ("committed", "entries", "keys", "num_tokens", "swapped", "table")

    def __init__(self, table: list[int], num_tokens: int) -> None:
        self.table = table
        self.num_tokens = num_tokens
        self.swapped = False
        self.keys: list[int] = []
        self.entries: list[int | None] = []
        self.committed = 0


class BlockManager:
    """Block tables of every sequence over one GPU pool and one CPU swap pool.

    Invariants (checked by the property tests):

    * ``len(table) == blocks_for(num_tokens)`` and no block id appears twice in one table;
    * every block's ref count equals the number of tables (on its device) holding it;
    * a slot returned for writing belongs to a block held by exactly one table (copy-on-write protects sharers);
    * every operation that raises leaves the state unchanged.

    Cost: every operation is O(blocks it touches) (plus the group size for swaps); :meth:`stats` is O(live tables).
    """

    def __init__(
        self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, *, enable_prefix_caching: bool = False
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
        self._num_logical = 0  # sum of len(table) over resident tables, kept by every operation (usage() is O(1))
        self.prefix_queries = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
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
        shift, mask = self._shift, self._mask
        return [(table[p >> shift] << shift) | (p & mask) for p in range(start, end)]

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

    def _group(self, seq_ids: Iterable[Hashable], swapped: bool, action: str) -> list[_Seq]:
        """Validate a sequence group for a swap: known, distinct, all on the expected device."""
        if isinstance(seq_ids, (str, bytes)):
            raise TypeError(f"seq_ids must be a collection of sequence ids, got the single string {seq_ids!r}")
        ids = list(seq_ids)
        seqs = []
        seen = set()
        for seq_id in ids:
            seq = self._get(seq_id, "seq_ids entry")
            if seq_id in seen:
                raise ValueError(f"seq_ids lists {seq_id!r} twice")
            seen.add(seq_id)
            if seq.swapped != swapped:
                state = "already swapped out" if seq.swapped else "not swapped out"
                raise ValueError(f"seq_ids entry {seq_id!r} is {state}; cannot {action}")
            seqs.append(seq)
        return seqs

    @staticmethod
    def _distinct_blocks(seqs: list[_Seq]) -> dict[int, int]:
        """Block id -> number of group tables holding it, in first-appearance order (a shared block moves once)."""
        counts: dict[int, int] = {}
        for seq in seqs:
            for block in seq.table:
                counts[block] = counts.get(block, 0) + 1
        return counts

    def _move(self, seqs: list[_Seq], src: BlockAllocator, dst: BlockAllocator, to_cpu: bool) -> list[tuple[int, int]]:
        """Move a validated group's blocks from ``src`` to ``dst``, preserving sharing within the group.

        A block also held by tables outside the group stays allocated in ``src`` for them (only the group's
        references are dropped); the group gets its own copy in ``dst``.
        """
        counts = self._distinct_blocks(seqs)
        if len(counts) > dst.num_free:
            where = "CPU" if to_cpu else "GPU"
            raise NoFreeBlocksError(f"swap needs {len(counts)} free {where} blocks, only {dst.num_free} are free")
        mapping: dict[int, int] = {}
        for block, count in counts.items():
            new = dst.allocate()
            for _ in range(count - 1):
                dst.incref(new)
            mapping[block] = new
        for seq in seqs:
            for block in seq.table:
                src.decref(block)
            seq.table = [mapping[block] for block in seq.table]
            seq.swapped = to_cpu
            self._num_logical += -len(seq.table) if to_cpu else len(seq.table)
        return list(mapping.items())

    # ------------------------------------------------------------------ sizing

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        n = _as_int("num_tokens", num_tokens, 0)
        return (n + self._mask) >> self._shift

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
        table = [self.gpu.allocate() for _ in range(need)]
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
        self.gpu.incref_many(parent.table)
        child = self._seqs[child_id] = _Seq(list(parent.table), parent.num_tokens)
        self._num_logical += len(parent.table)
        if self.enable_prefix_caching:
            child.keys, child.entries, child.committed = list(parent.keys), list(parent.entries), parent.committed
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

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> AppendResult:
        """Reserve slots for the next ``num_new_tokens`` tokens of a resident sequence.

        If the last block is partial and shared, it is first replaced by a fresh block: ``copies`` gets
        ``(old, new)`` and ``old`` loses this table's reference. All-or-nothing: on :class:`NoFreeBlocksError`
        nothing changes.
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
        for _ in range(new_blocks):
            table.append(self.gpu.allocate())
        self._num_logical += new_blocks
        start = seq.num_tokens
        seq.num_tokens = start + k
        return AppendResult(slots=self._slots(table, start, start + k), copies=copies)

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
        states: list[_Seq] = []
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
        new_blocks = need
        for block, holders in cow_holders.items():
            need += holders - 1 if holders == refs[block] else holders
        if need > gpu.num_free:
            return None
        allocate = gpu.allocate
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        for seq in states:
            n = seq.num_tokens
            table = seq.table
            if not n & mask:
                table.append(allocate())
            elif refs[table[-1]] > 1:  # shared partial last block: copy it (the last holder finds ref 1: in place)
                old = table[-1]
                new = allocate()
                refs[old] -= 1
                if refs[old] == 1:
                    gpu._num_shared -= 1
                table[-1] = new
                copies.append((old, new))
            slots.append((table[-1] << shift) | (n & mask))
            seq.num_tokens = n + 1
        self._num_logical += new_blocks
        return AppendResult(slots=slots, copies=copies)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens and release the blocks past them (cache cropping).

        Works on either device. If the new last block is partial and still shared, the next append copies it, so a
        sharer that still uses the cut-off positions is never overwritten.
        """
        seq = self._get(seq_id)
        n = _as_int("num_tokens", num_tokens, 0)
        if n > seq.num_tokens:
            raise ValueError(f"num_tokens must be <= {seq.num_tokens} (the length of seq_id {seq_id!r}), got {n}")
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
            allocator.decref_many(seq.table[::-1])  # tail first into the LRU pool: evicted before the shared prefix
        else:
            allocator.decref_many(seq.table)
        if not seq.swapped:
            self._num_logical -= len(seq.table)
        del self._seqs[seq_id]

    def reset(self) -> None:
        """Drop every table; every block of both pools becomes free (allocator objects are kept)."""
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

    def table_view(self, seq_id: Hashable) -> list[int]:
        """The live table itself, not a copy (hot paths): read it, never modify it, and do not keep it across
        operations that may replace it (swaps)."""
        return self._get(seq_id).table

    def usage(self) -> tuple[int, int]:
        """``(used_blocks, logical_blocks)`` of the GPU pool in O(1): physical blocks in use, and the blocks the
        resident tables would use without sharing (see :meth:`stats`, which also measures fragmentation)."""
        return self.gpu.num_used, self._num_logical

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the table; CPU block ids while the sequence is swapped out (see :meth:`is_swapped`)."""
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
        """Usage of the GPU pool, O(live tables).

        ``used_slots`` counts each physical block once, as full unless every table holding it sees it as its partial
        last block, in which case it holds as many tokens as the longest of those views. (After a truncate into a
        shared block, holders can disagree on how much of it is filled; the tokens of the longest view are live.)
        """
        gpu, mask, bs = self.gpu, self._mask, self.block_size
        logical = 0
        partial: dict[int, list[int]] = {}  # last block -> [tables seeing it partial, longest partial view]
        for seq in self._seqs.values():
            if seq.swapped:
                continue
            logical += len(seq.table)
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
            num_blocks=self.num_blocks,
            used_blocks=used_blocks,
            free_blocks=gpu.num_free,
            shared_blocks=gpu.num_shared,
            logical_blocks=logical,
            allocated_slots=allocated,
            used_slots=used_slots,
            waste_slots=allocated - used_slots,
            cpu_blocks=self.num_cpu_blocks,
            cpu_used_blocks=self.cpu.num_used,
            cpu_free_blocks=self.cpu.num_free,
            cached_blocks=getattr(gpu, "num_evictable", 0),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
        )

    # ------------------------------------------------------------------ prefix caching (§4.4 shared prefix)

    def _add_pending(self, keys: list[int], start: int) -> None:
        pending = self._pending
        for key in keys[start:]:
            pending[key] = pending.get(key, 0) + 1

    def _drop_pending(self, keys: list[int], start: int) -> None:
        pending = self._pending
        for key in keys[start:]:
            count = pending.get(key, 0) - 1
            if count > 0:
                pending[key] = count
            else:
                pending.pop(key, None)

    def _chain_keys(self, token_ids: Sequence[int], num_blocks: int) -> tuple[list[int], list[tuple[int, ...]]]:
        shift = self._shift
        keys: list[int] = []
        chunks: list[tuple[int, ...]] = []
        key = ROOT_KEY
        for i in range(num_blocks):
            chunk = tuple(token_ids[i << shift : (i + 1) << shift])
            key = hash_block(key, chunk)
            keys.append(key)
            chunks.append(chunk)
        return keys, chunks

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The cached whole-block prefix a new sequence with ``token_ids`` would get now; changes nothing.

        Walks the chain of full blocks, stopping at the first block that is not cached with exactly these tokens
        after exactly the prefix matched so far. At most ``(len(token_ids) - 1) // block_size`` blocks are used, so
        at least one token (the last) is left to compute. Without prefix caching: an empty match.
        """
        n = len(token_ids)
        if not self.enable_prefix_caching or n <= 0:
            return PrefixMatch(num_tokens=n)
        gpu: CachingBlockAllocator = self.gpu  # type: ignore[assignment]
        keys, chunks = self._chain_keys(token_ids, n >> self._shift)
        usable = (n - 1) >> self._shift
        blocks: list[int] = []
        entries: list[int] = []
        parent = ROOT_ENTRY
        for key, chunk in zip(keys, chunks):
            entry = gpu.lookup(key, parent, chunk)
            if entry is None:
                break
            blocks.append(entry.block)
            entries.append(entry.id)
            parent = entry.id
        hits = len(blocks)
        mapped = min(hits, usable)
        pending = hits < usable and keys[hits] in self._pending
        return PrefixMatch(
            num_tokens=n,
            num_cached_tokens=mapped << self._shift,
            blocks=tuple(blocks[:mapped]),
            entries=tuple(entries[:mapped]),
            keys=tuple(keys),
            num_hit_blocks=hits,
            pending=pending,
        )

    def blocks_needed_to_admit(self, requests: Iterable[tuple[PrefixMatch, int]]) -> int:
        """GPU blocks that admitting sequences takes: :meth:`allocate_prefix` of each match, then
        :meth:`append_slots` of its next ``num_new_tokens`` tokens (a cached block mapped by several counts once;
        cached blocks in use by others cost nothing, evictable ones count since they leave the free pool)."""
        total = 0
        evictable: set[int] = set()
        gpu, shift = self.gpu, self._shift
        for match, num_new_tokens in requests:
            k = _as_int("num_new_tokens", num_new_tokens, 0)
            for block in match.blocks:
                if gpu.ref_count(block) == 0:
                    evictable.add(block)
            cached = match.num_cached_tokens
            total += self.blocks_for(cached + k) - (cached >> shift)
        return total + len(evictable)

    def allocate_prefix(self, seq_id: Hashable, token_ids: Sequence[int], match: PrefixMatch | None = None) -> int:
        """Create the table of a new sequence whose tokens will be ``token_ids``, mapping its cached prefix.

        Returns the number of leading tokens already cached (a multiple of the block size, < ``len(token_ids)``);
        the table holds exactly those, so the caller computes the rest via :meth:`append_slots`. ``match`` (from
        :meth:`match_prefix` with no allocation in between) avoids hashing again. Never allocates a new block.
        Without prefix caching this is ``allocate(seq_id, 0)`` and returns 0.
        """
        if self.has_seq(seq_id):
            raise ValueError(f"seq_id {seq_id!r} already exists")
        if not self.enable_prefix_caching:
            self._seqs[seq_id] = _Seq([], 0)
            return 0
        if match is None:
            match = self.match_prefix(token_ids)
        elif match.num_tokens != len(token_ids):
            raise ValueError(f"match is for {match.num_tokens} tokens, token_ids has {len(token_ids)}")
        gpu: CachingBlockAllocator = self.gpu  # type: ignore[assignment]
        for block, entry_id in zip(match.blocks, match.entries):
            if gpu.entry_id(block) != entry_id:
                raise ValueError("stale match: a matched block was evicted since match_prefix; match again")
        for block in match.blocks:
            gpu.acquire(block)
        seq = self._seqs[seq_id] = _Seq(list(match.blocks), match.num_cached_tokens)
        self._num_logical += len(match.blocks)
        seq.keys = list(match.keys)
        seq.entries = list(match.entries)
        seq.committed = len(match.blocks)
        self._add_pending(seq.keys, seq.committed)
        self.prefix_queries += 1
        self.prefix_query_tokens += match.num_tokens
        self.prefix_hit_tokens += match.num_cached_tokens
        return match.num_cached_tokens

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> int:
        """Key the full blocks among the first ``num_computed`` tokens (their KV is written); return how many.

        Call after the forward that wrote them (the scheduler does, before each step, at preemption and before a
        sequence is freed). ``token_ids`` are the sequence's tokens (those given to :meth:`allocate_prefix`,
        extended). Cheap when no new block became full. No-op without prefix caching or while swapped out.
        """
        seq = self._get(seq_id)
        if not self.enable_prefix_caching or seq.swapped:
            return 0
        shift = self._shift
        n = num_computed
        if type(n) is not int or n < 0:  # validate off the per-step fast path
            n = _as_int("num_computed", num_computed, 0)
        start = seq.committed
        if min(n, seq.num_tokens) >> shift <= start:  # the per-step common case: no block became full
            return 0
        full = min(n, seq.num_tokens, len(token_ids)) >> shift
        if full <= start:
            return 0
        gpu: CachingBlockAllocator = self.gpu  # type: ignore[assignment]
        keys, entries, table = seq.keys, seq.entries, seq.table
        self._drop_pending(keys[:full], start)
        for i in range(start, full):
            chunk = tuple(token_ids[i << shift : (i + 1) << shift])
            if i == len(keys):
                keys.append(hash_block(keys[i - 1] if i else ROOT_KEY, chunk))
            parent = entries[i - 1] if i else ROOT_ENTRY
            entries.append(None if parent is None else gpu.register(table[i], keys[i], parent, chunk))
        seq.committed = full
        return full - start

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Hit counters and cache occupancy (see :class:`PrefixCacheStats`)."""
        gpu = self.gpu
        return PrefixCacheStats(
            enabled=self.enable_prefix_caching,
            queries=self.prefix_queries,
            query_tokens=self.prefix_query_tokens,
            hit_tokens=self.prefix_hit_tokens,
            cached_blocks=getattr(gpu, "num_cached", 0),
            evictable_blocks=getattr(gpu, "num_evictable", 0),
            evictions=getattr(gpu, "num_evictions", 0),
        )

    # ------------------------------------------------------------------ swapping (§4.5)

    def blocks_needed_to_swap_out(self, seq_ids: Iterable[Hashable]) -> int:
        """CPU blocks :meth:`swap_out` of this group would take (blocks shared inside the group count once)."""
        return len(self._distinct_blocks(self._group(seq_ids, swapped=False, action="swap out")))

    def blocks_needed_to_swap_in(self, seq_ids: Iterable[Hashable]) -> int:
        """GPU blocks :meth:`swap_in` of this group would take (exact count, no headroom for the next token)."""
        return len(self._distinct_blocks(self._group(seq_ids, swapped=True, action="swap in")))

    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the CPU pool can take the whole group now."""
        return self.blocks_needed_to_swap_out(seq_ids) <= self.cpu.num_free

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move a resident sequence group to the CPU pool, all or nothing.

        Returns the ``(gpu_block, cpu_block)`` pairs to copy; the caller must copy them before the freed GPU blocks
        are written again (i.e. before the next step's writes). Blocks shared inside the group move once and stay
        shared on the CPU.
        """
        seqs = self._group(seq_ids, swapped=False, action="swap out")
        return self._move(seqs, self.gpu, self.cpu, to_cpu=True)

    def blocks_needed_to_swap_in_and_append(self, requests: Iterable[tuple[Hashable, int]]) -> int:
        """Exact GPU blocks that :meth:`swap_in` of a swapped group and then :meth:`append_slots` of each
        ``(seq_id, num_new_tokens)`` take: the group's distinct blocks plus its new blocks and copy-on-writes.

        A swapped group shares CPU blocks only inside itself and :meth:`swap_in` keeps that sharing, so the append
        plan read off the CPU tables is the plan the sequences will have on the GPU.
        """
        pairs = [(seq_id, _as_int("num_new_tokens", k, 0)) for seq_id, k in requests]
        seqs = self._group([seq_id for seq_id, _ in pairs], swapped=True, action="swap in")
        appends = self._count_appends([(seq_id, seq, k) for (seq_id, k), seq in zip(pairs, seqs)], self.cpu)
        return len(self._distinct_blocks(seqs)) + appends

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the GPU pool can take the whole group back now (exact block count, no headroom)."""
        return self.blocks_needed_to_swap_in(seq_ids) <= self.gpu.num_free

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move a swapped sequence group back to the GPU pool, all or nothing; returns ``(cpu_block, gpu_block)``.

        Swap a group back with the same grouping it was swapped out with: sharing is only preserved inside a group.
        """
        seqs = self._group(seq_ids, swapped=True, action="swap in")
        return self._move(seqs, self.cpu, self.gpu, to_cpu=False)
