"""`GroupedBlockManager`: one block table per layer group over one pool, for mixed sliding / full stacks (pure Python).

Why: see `hf_paged.core.layer_groups` (a mixed stack's local layers can only free the blocks before their window
when they have tables of their own). This class gives the scheduler and the engine the `BlockManager` interface they
already use, keyed by sequence id, and keeps one table per group underneath.

How: every sequence ``s`` is ``num_groups`` sub-sequences ``(s, g)`` of one inner `BlockManager` (one allocator, one
block-id space, one CPU pool). So every invariant of `BlockManager` (ref counts, copy-on-write of shared partial
blocks, swap pairs, all-or-nothing on failure) holds per group for free, and a block id is held by one group's
tables only: forks share blocks within a group, and the prefix cache's keys are salted by group (`group_salt`: the
K/V of a local layer and of a global layer over the same tokens differ). All groups of a sequence hold the same
tokens; group ``g > 0`` with a window ``W`` releases its blocks before ``num_computed - W + 1`` (the inner
`release_out_of_window`), group 0 is a full group and keeps every block.

* Operations that may fail (append, allocate, truncate) check every group first and change nothing on failure; a
  step's copy-on-write and swap pairs are those of every group (block ids are global, so the pool applies each pair
  to every slot tensor).
* Sizes: `blocks_for(n)` is what a fresh sequence of ``n`` tokens takes, ``num_groups`` tables' worth (admission of
  a first chunk: nothing is released before a step); `blocks_to_hold(n, chunk)` is the most a sequence ever holds
  (a sliding group: its window and a chunk), what `add_request` checks against the pool (`token_capacity`).
* Prefix caching: a hit is the shortest of the groups' hits (each group's match is cut to it), and a sliding group
  maps only the hit's blocks that its window still reads (`allocate_prefix` releases the others at once, and
  `blocks_needed_to_admit` counts only those). A sliding group's committed blocks stay cached (evictable) after their
  release, but they are released first and so evicted first: under memory pressure a hit may be cut short by a
  sliding group (vLLM's sliding-window manager, which needs only the window's blocks before the hit point, would
  keep it; here a lookup verifies the whole chain). `chain_keys` returns one key list per group.
* Tables the runner reads: `table_view` / `table_views` are group 0's (whose slots `append_slots` returns);
  `group_tables` gives each group's. Statistics (`stats`) count every group's blocks; prefix counters are per
  sequence, not per group.
* Not supported (the cache keeps one table for them): recurrent state slots (hybrid models).
* The persistent decode batch (`hf_paged.core.decode_batch`) reads and advances the inner manager's records of each
  group directly, one lane per group, and releases each sliding group's blocks as its rows advance.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace

from .block_manager import BlockManager
from .block_pool import NoFreeBlocksError, _as_int
from .block_stats import AppendResult, BlockStats, PrefixCacheStats, PrefixMatch

__all__ = ["GroupedBlockManager", "GroupedMatch", "group_salt"]


def group_salt(salt: int, group: int) -> int:
    """The prefix-cache salt of `group`'s blocks of a sequence salted `salt` (group 0 keeps `salt`): other groups'
    K/V of the same tokens are other data, so their chains start from another root (`block_pool.salted_root`).

    Distinct for every (salt, group) without hashing, so even colliding chain keys never let one group's lookup
    verify against another's entries (the root's parent entry is ``-salt``): group ``g > 0`` takes
    ``2**62 + salt * 256 + g``, above every salt a request has (a LoRA adapter's id: a small count) and within the
    int64 that a salt is hashed as. Groups are fewer than 256 (`plan_layer_groups` makes at most one per layer of a
    kind, and a model has a few hundred layers at most).
    """
    if group == 0:
        return salt
    if not 0 < group < 256 or not 0 <= salt < 2**53:
        raise ValueError(f"group_salt: group must be in 1..255 and salt in 0..2**53, got {group!r} and {salt!r}")
    return (1 << 62) | (salt << 8) | group


@dataclass(frozen=True)
class GroupedMatch:
    """`match_prefix` of a grouped manager: each group's match, all cut to the same cached tokens."""

    num_tokens: int
    num_cached_tokens: int
    pending: bool
    groups: tuple[PrefixMatch, ...]
    state_key: None = None


class _Sub:
    """A sequence seen as its group-`g` sub-sequence (what the inner release takes: id, computed tokens, tokens)."""

    __slots__ = ("seq_id", "num_computed", "token_ids")

    def __init__(self, seq_id: tuple, num_computed: int, token_ids: Sequence[int]) -> None:
        self.seq_id, self.num_computed, self.token_ids = seq_id, num_computed, token_ids


class GroupedBlockManager:
    """`BlockManager`'s interface over one table per layer group (module docstring).

    Why one class of this size: it is the whole interface the scheduler, the engine and the runner call on a block
    manager, each method a short mapping of a sequence onto its groups' sub-sequences of the inner manager; split, the
    one mapping (and its all-or-nothing checks) would be spread over several classes.

    Args:
        num_blocks, block_size, num_cpu_blocks, enable_prefix_caching: as `BlockManager` (one pool for all groups).
        windows: each group's sliding window (None: full attention); ``windows[0]`` must be None.
    """

    grouped = True
    state = None  # no recurrent-state slots (hybrid models keep one table)

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None], num_cpu_blocks: int = 0, *,
                 enable_prefix_caching: bool = False) -> None:
        windows = tuple(windows)
        if not windows or windows[0] is not None or len(windows) > 255:
            raise ValueError(f"windows must start with a full group (None), at most 255 groups, got {windows!r}")
        for w in windows[1:]:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"a group's window must be a positive int or None, got {w!r}")
        self.windows = windows
        self.num_groups = len(windows)
        self._sliding = [(g, w) for g, w in enumerate(windows) if w is not None]
        self.inner = BlockManager(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching=enable_prefix_caching)
        self.releasing = True  # off when the layers' windows contradict the plan (`GroupedPagedCache`)
        # the last `append_decode_slots`: (group 0's slots, the other groups' slots of the same tokens), taken once by
        # the runner's static step (`runner.group_static`), which checks group 0's against its step's; any other
        # change to the tables drops it
        self.decode_group_slots: tuple[list[int], list[list[int]]] | None = None

    def __repr__(self) -> str:
        return f"GroupedBlockManager(windows={self.windows}, {self.inner!r})"

    # ------------------------------------------------------------------ the inner manager's pool
    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.inner.num_cpu_blocks

    @property
    def gpu(self):
        return self.inner.gpu

    @property
    def cpu(self):
        return self.inner.cpu

    @property
    def enable_prefix_caching(self) -> bool:
        return self.inner.enable_prefix_caching

    @property
    def window_released(self) -> int:
        return self.inner.window_released

    @property
    def prefix_query_tokens(self) -> int:
        return self.inner.prefix_query_tokens // self.num_groups

    @property
    def prefix_hit_tokens(self) -> int:
        return self.inner.prefix_hit_tokens // self.num_groups

    def set_prefix_caching(self, enabled: bool) -> None:
        self.inner.set_prefix_caching(enabled)

    def grow(self, num_blocks: int) -> None:
        self.inner.grow(num_blocks)

    def reset(self) -> None:
        self.inner.reset()

    def reset_prefix_cache(self) -> int:
        return self.inner.reset_prefix_cache()

    # ------------------------------------------------------------------ helpers
    def _subs(self, seq_id: Hashable) -> list[tuple]:
        return [(seq_id, g) for g in range(self.num_groups)]

    def _flat(self, requests: Iterable[tuple[Hashable, int]]) -> list[tuple[tuple, int]]:
        return [((seq_id, g), n) for seq_id, n in requests for g in range(self.num_groups)]

    def _check(self, seq_id: Hashable) -> None:
        if not self.has_seq(seq_id):
            raise ValueError(f"seq_id {seq_id!r} is unknown")

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a fresh sequence of `num_tokens` tokens takes: one table's worth in every group."""
        return self.num_groups * self.inner.blocks_for(num_tokens)

    def blocks_to_hold(self, num_tokens: int, chunk: int) -> int:
        """Most blocks one sequence of `num_tokens` tokens holds at once, prefilled in chunks of at most `chunk`
        tokens (what `add_request` checks against the pool): a full group's whole table, a sliding group's window
        and chunk (a step of ``k`` tokens after position ``s`` holds the blocks of ``[s - W + 1, s + k)``, at most
        ``blocks_for(W - 1 + k) + 1``), unless `releasing` is off."""
        per_table = self.inner.blocks_for(num_tokens)
        if not self.releasing:
            return self.num_groups * per_table
        chunk = _as_int("chunk", chunk, 1)
        return sum(per_table if w is None else min(per_table, self.inner.blocks_for(w - 1 + chunk) + 1)
                   for w in self.windows)

    def token_capacity(self, chunk: int) -> int:
        """The longest sequence the whole pool can hold (`blocks_to_hold` within `num_blocks`), in whole blocks."""
        low, high = 0, self.num_blocks  # table lengths: `blocks_to_hold` grows with them
        while low < high:
            mid = (low + high + 1) // 2
            if self.blocks_to_hold(mid << self.inner._shift, chunk) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low << self.inner._shift

    # ------------------------------------------------------------------ lifecycle
    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        n = _as_int("num_tokens", num_tokens, 0)
        if self.has_seq(seq_id):
            raise ValueError(f"seq_id {seq_id!r} already exists")
        need = self.blocks_for(n)
        if need > self.gpu.num_free:
            raise NoFreeBlocksError(f"allocating {n} tokens needs {need} blocks, only {self.gpu.num_free} are free")
        tables = [self.inner.allocate(sub, n) for sub in self._subs(seq_id)]
        for g, sub in enumerate(self._subs(seq_id)):  # its blocks' keys, once committed, are salted by group
            self.inner._seqs[sub].salt = group_salt(0, g)
        return tables[0]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        self._check(parent_id)
        if self.has_seq(child_id):
            raise ValueError(f"child_id {child_id!r} already exists")
        for g in range(self.num_groups):
            self.inner.fork((parent_id, g), (child_id, g))

    def free(self, seq_id: Hashable) -> None:
        self._check(seq_id)
        self.decode_group_slots = None
        for sub in self._subs(seq_id):
            self.inner.free(sub)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        self._check(seq_id)
        n = _as_int("num_tokens", num_tokens, 0)
        shift = self.inner._shift
        for sub in self._subs(seq_id):  # every group accepts it, or nothing changes
            seq = self.inner._get(sub)
            if n > seq.num_tokens or n < seq.released << shift:
                self.inner.truncate(sub, n)  # raises the documented ValueError
        for sub in self._subs(seq_id):
            self.inner.truncate(sub, n)

    # ------------------------------------------------------------------ appends
    def blocks_needed_to_append(self, seq_id: Hashable, num_new_tokens: int = 1) -> int:
        return self.inner.blocks_needed_to_append_many(self._flat([(seq_id, num_new_tokens)]))

    def blocks_needed_to_append_many(self, requests: Iterable[tuple[Hashable, int]]) -> int:
        return self.inner.blocks_needed_to_append_many(self._flat(requests))

    def can_append(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        return self.blocks_needed_to_append(seq_id, num_new_tokens) <= self.gpu.num_free

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> AppendResult:
        """Every group's next slots, all or nothing; the slots returned are group 0's, the copies every group's."""
        need = self.blocks_needed_to_append(seq_id, num_new_tokens)
        if need > self.gpu.num_free:
            raise NoFreeBlocksError(f"appending {num_new_tokens} tokens to seq_id {seq_id!r} needs {need} blocks, "
                                    f"only {self.gpu.num_free} are free")
        subs = self._subs(seq_id)  # the other groups' slots are read off their tables when a step needs them
        results = [self.inner.append_slots(sub, num_new_tokens, slots=not g) for g, sub in enumerate(subs)]
        return AppendResult(slots=results[0].slots, copies=[pair for r in results for pair in r.copies])

    def append_decode_slots(self, seq_ids: Sequence[Hashable], token_ids: Sequence[Sequence[int]] | None = None,
                            num_computed: Sequence[int] | None = None) -> AppendResult | None:
        """One decode slot of every sequence in every group, all or nothing (None: the per-sequence path)."""
        k = self.num_groups
        subs = [(seq_id, g) for g in range(k) for seq_id in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids lists a sequence twice")
        result = self.inner.append_decode_slots(subs, None if token_ids is None else list(token_ids) * k,
                                                None if num_computed is None else list(num_computed) * k)
        if result is None:
            self.decode_group_slots = None
            return None
        n = len(seq_ids)
        self.decode_group_slots = (result.slots[:n], [result.slots[g * n : (g + 1) * n] for g in range(1, k)])
        return AppendResult(slots=result.slots[:n], copies=result.copies)

    # ------------------------------------------------------------------ sliding release
    def release_out_of_window(self, seqs: Iterable, window: int | None = None) -> int:
        """Release every sliding group's blocks before its own window (`window`, the scheduler's largest one, is not
        used: each group has its own); nothing while `releasing` is off."""
        if not self.releasing:
            return 0
        shift, states = self.inner._shift, self.inner._seqs
        due: dict[int, list[_Sub]] = {}  # the hot path: a (sequence, group) with nothing new to release costs a lookup
        for s in seqs:
            for g, w in self._sliding:
                if (s.num_computed - w + 1) >> shift > states[s.seq_id, g].released:
                    due.setdefault(g, []).append(_Sub((s.seq_id, g), s.num_computed, s.token_ids))
        return sum(self.inner.release_out_of_window(subs, self.windows[g]) for g, subs in due.items())

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        return self.inner.can_swap_out([sub for s in seq_ids for sub in self._subs(s)])

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        return self.inner.swap_out([sub for s in seq_ids for sub in self._subs(s)])

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> bool:
        return self.inner.can_swap_in([sub for s in seq_ids for sub in self._subs(s)])

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        return self.inner.swap_in([sub for s in seq_ids for sub in self._subs(s)])

    def blocks_needed_to_swap_in_and_append(self, requests: Iterable[tuple[Hashable, int]]) -> int:
        return self.inner.blocks_needed_to_swap_in_and_append(self._flat(requests))

    # ------------------------------------------------------------------ prefix caching
    def chain_keys(self, token_ids: Sequence[int], salt: int = 0) -> tuple[list[int], ...]:
        """Each group's chain keys of `token_ids` (salted by group)."""
        return tuple(self.inner.chain_keys(token_ids, group_salt(salt, g)) for g in range(self.num_groups))

    def match_prefix(self, token_ids: Sequence[int], max_cached_tokens: int | None = None, *,
                     known_keys: Sequence = (), salt: int = 0) -> GroupedMatch:
        """The prefix every group has cached: each group's match, cut to the shortest of them."""
        def match(g: int, cap: int | None) -> PrefixMatch:
            keys = known_keys[g] if known_keys else ()
            return self.inner.match_prefix(token_ids, cap, known_keys=keys, salt=group_salt(salt, g))

        matches = [match(g, max_cached_tokens) for g in range(self.num_groups)]
        cached = min(m.num_cached_tokens for m in matches)
        matches = [m if m.num_cached_tokens == cached else match(g, cached) for g, m in enumerate(matches)]
        return GroupedMatch(len(token_ids), cached, any(m.pending for m in matches), tuple(matches))

    def _in_window(self, match: PrefixMatch, group: int) -> PrefixMatch:
        """`match` as group `group` keeps it at admission: a sliding group maps only the blocks its window still
        reads before the first token to compute (`allocate_prefix` releases the others at once)."""
        window = self.windows[group]
        if window is None or not self.releasing or not match.blocks:
            return match
        first = max(0, match.num_cached_tokens - window + 1) >> self.inner._shift
        return replace(match, blocks=match.blocks[first:], entries=match.entries[first:])

    def blocks_needed_to_admit(self, requests: Iterable[tuple[GroupedMatch, int]]) -> int:
        """Blocks that admitting the matches takes: every group's new blocks, and the evictable cached blocks it
        maps (a sliding group's within its window only)."""
        return self.inner.blocks_needed_to_admit((self._in_window(m, g), n) for match, n in requests
                                                 for g, m in enumerate(match.groups))

    def allocate_prefix(self, seq_id: Hashable, token_ids: Sequence[int], match: GroupedMatch | None = None) -> int:
        if self.has_seq(seq_id):
            raise ValueError(f"seq_id {seq_id!r} already exists")
        if match is None:
            match = self.match_prefix(token_ids)
        for m in match.groups:  # a stale match raises here, before any group changed
            for block, entry_id in zip(m.blocks, m.entries):
                if self.enable_prefix_caching and self.gpu.entry_id(block) != entry_id:
                    raise ValueError("stale match: a matched block was evicted since match_prefix; match again")
        counts = [self.inner.allocate_prefix((seq_id, g), token_ids, m) for g, m in enumerate(match.groups)]
        for g, window in enumerate(self.windows):  # a sliding group keeps what its window reads (`_in_window`)
            if window is not None and self.releasing:
                self.inner.release_before((seq_id, g), max(0, counts[g] - window + 1))
        return counts[0]

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> int:
        return [self.inner.commit(sub, token_ids, num_computed) for sub in self._subs(seq_id)][0]

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The inner cache's counters, with queries and tokens per sequence (every group is queried alike)."""
        s, k = self.inner.prefix_cache_stats(), self.num_groups
        return PrefixCacheStats(s.enabled, s.queries // k, s.query_tokens // k, s.hit_tokens // k, s.cached_blocks,
                                s.evictable_blocks, s.evictions)

    # ------------------------------------------------------------------ queries
    def has_seq(self, seq_id: Hashable) -> bool:
        try:
            return self.inner.has_seq((seq_id, 0))
        except TypeError:
            return False

    def seq_ids(self) -> list:
        return [sub[0] for sub in self.inner.seq_ids() if sub[1] == 0]

    def table_view(self, seq_id: Hashable) -> list[int]:
        return self.inner.table_view((seq_id, 0))

    def table_views(self, seq_ids: Sequence[Hashable]) -> list[list[int]]:
        return self.inner.table_views([(s, 0) for s in seq_ids])

    def group_tables(self, seq_id: Hashable) -> list[list[int]]:
        """Each group's live table of a sequence (read only; released entries are `NULL_BLOCK`)."""
        return [self.inner.table_view(sub) for sub in self._subs(seq_id)]

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of group 0's table."""
        return self.inner.block_table((seq_id, 0))

    def held_blocks(self, seq_id: Hashable) -> int:
        """Blocks the sequence's tables hold now, over every group (released entries excluded)."""
        return sum(self.inner._get(sub).num_held for sub in self._subs(seq_id))

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.inner.num_tokens((seq_id, 0))

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self.inner.is_swapped((seq_id, 0))

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        return self.inner.slot_mapping((seq_id, 0), start, end)

    def group_slots(self, seq_id: Hashable, group: int, start: int, end: int) -> list[int]:
        """Physical slots of tokens ``[start, end)`` in `group`'s table."""
        return self.inner.slot_mapping((seq_id, group), start, end)

    def usage(self) -> tuple[int, int]:
        return self.inner.usage()

    def stats(self) -> BlockStats:
        """The pool's usage over every group's tables (`BlockManager.stats`); prefix counters per sequence."""
        return replace(self.inner.stats(), prefix_query_tokens=self.prefix_query_tokens,
                       prefix_hit_tokens=self.prefix_hit_tokens)
