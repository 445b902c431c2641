"""Block pool: free list and reference counts of physical KV blocks, plus the prefix-cache index (pure Python).

`BlockAllocator` hands out block ids and counts their holders; `CachingBlockAllocator` adds the automatic prefix
cache's entries (content keys chained with `hash_block`, verified token by token) and the evictable LRU pool of
cached blocks nobody holds. Called by `hf_paged.core.block_manager` only; it never touches tensors. With a prefix
cache, truly free + used (ref >= 1) + evictable (ref 0, entry kept) == total; `num_free`, what the scheduler sees, is
free + evictable.
"""

from __future__ import annotations

import operator
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

__all__ = ["BlockAllocator", "CachingBlockAllocator", "NoFreeBlocksError", "hash_block", "ROOT_KEY", "ROOT_ENTRY",
           "salted_root"]

ROOT_KEY = 0x9E3779B97F4A7C15  # chain key "before" the first block
ROOT_ENTRY = 0  # parent entry id of a first block; real entry ids start at 1

_digest: Callable[[bytes], int] | None = None


def salted_root(salt: int) -> tuple[int, int]:
    """(chain key, parent entry) before the first block of a sequence whose K/V depend on `salt` as well as on its
    tokens (a LoRA adapter's id: the same prompt through another adapter has other K/V). Salt 0 is the plain root.
    The parent entry is part of what a lookup verifies, so two salts never share a block even when their keys
    collide (entry ids are positive, so ``-salt`` is no real entry)."""
    if salt == 0:
        return ROOT_KEY, ROOT_ENTRY
    return hash_block(ROOT_KEY, (salt,)), -salt


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


def chain_hashes(parent_key: int, token_ids: Sequence[int], num_blocks: int, block_size: int) -> list[int]:
    """The keys of the first `num_blocks` full blocks of `token_ids` chained from `parent_key`: what `hash_block`
    called block by block gives, from one buffer of the tokens (a new 5k-token prompt's ~300 blocks without a tuple
    and an array each: its admission is planned while the GPU waits)."""
    digest = _digest or _load_digest()
    width = 8 * block_size
    data = array("q", token_ids[: num_blocks * block_size]).tobytes()
    keys: list[int] = []
    key = parent_key
    for at in range(0, num_blocks * width, width):
        key = digest(key.to_bytes(8, "little") + data[at : at + width])
        keys.append(key)
    return keys


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

    def grow(self, num_blocks: int) -> None:
        """Add free blocks `[self.num_blocks, num_blocks)` (a pool that grows on demand); existing ones keep their
        ids, references and order. The new blocks are allocated after the free blocks there already are."""
        n = _as_int("num_blocks", num_blocks, self.num_blocks)
        added = n - self.num_blocks
        self._ref.extend([0] * added)
        self._free[:0] = range(n - 1, self.num_blocks - 1, -1)
        self._grow_index(added)
        self.num_blocks = n

    def _grow_index(self, added: int) -> None:
        """Per-block state of subclasses grows with the pool."""

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

    def allocate_many(self, count: int) -> list[int]:
        """`count` calls of :meth:`allocate`, in their order, all or nothing: the blocks a long prefill chunk appends
        (a thousand for 16k tokens) without a call and a check each."""
        if count > self.num_free:
            raise NoFreeBlocksError(f"{count} blocks asked, only {self.num_free} are free")
        take, ref = self._take_free_block, self._ref
        blocks = [take() for _ in range(count)]
        for block in blocks:
            ref[block] = 1
        return blocks

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

    def _grow_index(self, added: int) -> None:
        self._entry_of.extend([None] * added)

    def forget_all(self) -> int:
        """Drop every entry (see `PrefixCaching.reset_prefix_cache`): evictable blocks become free; return how many
        entries there were."""
        count = sum(entry is not None for entry in self._entry_of)
        self._entry_of = [None] * self.num_blocks
        self._by_key.clear()
        self._free.extend(self._lru)
        self._lru.clear()
        return count

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


