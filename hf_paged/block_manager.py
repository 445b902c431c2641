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

The manager returns the copies the caller must perform (copy-on-write and swap pairs) instead of doing them, so the
tensor side can batch every copy of a step into one kernel launch (``hf_paged.kernels.copy_blocks``).
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["AppendResult", "BlockAllocator", "BlockManager", "BlockStats", "NoFreeBlocksError"]


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
        return self.num_blocks - len(self._free)

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
        if not self._free:
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

    def ref_count(self, block: int) -> int:
        """Number of tables holding the block (0 when free)."""
        return self._ref[self._check_block(block)]

    def is_free(self, block: int) -> bool:
        """Whether the block is in the free pool."""
        return self._ref[self._check_block(block)] == 0


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

    @property
    def waste_fraction(self) -> float:
        """Share of allocated slots holding no token (0 when nothing is allocated)."""
        return self.waste_slots / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def sharing_saving(self) -> float:
        """Share of logical blocks that sharing saved: ``1 - used / logical`` (0 when there are no tables)."""
        return 1.0 - self.used_blocks / self.logical_blocks if self.logical_blocks else 0.0


@dataclass(frozen=True)
class AppendResult:
    """What :meth:`BlockManager.append_slots` reserved.

    ``copies`` must be performed *before* the new tokens are written: the copied block holds the tokens that precede
    them in the same block.
    """

    slots: list[int]  # physical slot = block_id * block_size + offset, one per new token, in order
    copies: list[tuple[int, int]]  # (src_block, dst_block) copy-on-write pairs


class _Seq:
    """Per-sequence state. ``table`` holds GPU block ids, or CPU block ids while ``swapped``."""

    __slots__ = ("num_tokens", "swapped", "table")

    def __init__(self, table: list[int], num_tokens: int) -> None:
        self.table = table
        self.num_tokens = num_tokens
        self.swapped = False


class BlockManager:
    """Block tables of every sequence over one GPU pool and one CPU swap pool.

    Invariants (checked by the property tests):

    * ``len(table) == blocks_for(num_tokens)`` and no block id appears twice in one table;
    * every block's ref count equals the number of tables (on its device) holding it;
    * a slot returned for writing belongs to a block held by exactly one table (copy-on-write protects sharers);
    * every operation that raises leaves the state unchanged.

    Cost: every operation is O(blocks it touches) (plus the group size for swaps); :meth:`stats` is O(live tables).
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
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
        self.gpu = BlockAllocator(self.num_blocks)
        self.cpu = BlockAllocator(self.num_cpu_blocks)
        self._seqs: dict[Hashable, _Seq] = {}

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_cpu_blocks={self.num_cpu_blocks}, seqs={len(self._seqs)}, gpu_free={self.gpu.num_free})"
        )

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

    def _append_plan(self, seq: _Seq, num_new_tokens: int) -> tuple[bool, int]:
        """(copy-on-write needed, new blocks needed) to append ``num_new_tokens`` tokens to a resident sequence."""
        if num_new_tokens == 0:
            return False, 0
        n = seq.num_tokens
        # The last block can only be written in place if this table is its sole holder; a partial last block held
        # by others (fork, or a truncate that cut into a shared block) must be copied first.
        cow = bool(n & self._mask) and self.gpu.ref_count(seq.table[-1]) > 1
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
        return list(table)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (same tokens); never allocates.

        The shared partial last block (if any) is copied lazily by whichever of the two appends first.
        """
        parent = self._get_resident(parent_id, "forking it", "parent_id")
        if child_id in self._seqs:
            raise ValueError(f"child_id {child_id!r} already exists")
        for block in parent.table:
            self.gpu.incref(block)
        self._seqs[child_id] = _Seq(list(parent.table), parent.num_tokens)

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
        total = 0
        seen: set[Hashable] = set()
        cow_holders: dict[int, int] = {}  # shared partial last block -> appending holders
        for seq_id, num_new_tokens in requests:
            k = _as_int("num_new_tokens", num_new_tokens, 0)
            seq = self._get_resident(seq_id, "appending", "requests entry")
            if seq_id in seen:
                raise ValueError(f"requests lists {seq_id!r} twice")
            seen.add(seq_id)
            cow, new_blocks = self._append_plan(seq, k)
            total += new_blocks
            if cow:
                cow_holders[seq.table[-1]] = cow_holders.get(seq.table[-1], 0) + 1
        for block, holders in cow_holders.items():
            total += holders - 1 if holders == self.gpu.ref_count(block) else holders
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
        for _ in range(new_blocks):
            table.append(self.gpu.allocate())
        start = seq.num_tokens
        seq.num_tokens = start + k
        return AppendResult(slots=self._slots(table, start, start + k), copies=copies)

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
        for block in seq.table[keep:]:
            allocator.decref(block)
        del seq.table[keep:]
        seq.num_tokens = n

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence: release its references (on whichever device it lives) and forget its table."""
        seq = self._get(seq_id)
        allocator = self.cpu if seq.swapped else self.gpu
        for block in seq.table:
            allocator.decref(block)
        del self._seqs[seq_id]

    def reset(self) -> None:
        """Drop every table; every block of both pools becomes free (allocator objects are kept)."""
        self._seqs.clear()
        self.gpu._reset()
        self.cpu._reset()

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

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        """Whether the GPU pool can take the whole group back now (exact block count, no headroom)."""
        return self.blocks_needed_to_swap_in(seq_ids) <= self.gpu.num_free

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Move a swapped sequence group back to the GPU pool, all or nothing; returns ``(cpu_block, gpu_block)``.

        Swap a group back with the same grouping it was swapped out with: sharing is only preserved inside a group.
        """
        seqs = self._group(seq_ids, swapped=True, action="swap in")
        return self._move(seqs, self.cpu, self.gpu, to_cpu=False)
