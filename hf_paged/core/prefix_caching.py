"""Automatic prefix caching on the block tables (PagedAttention §4.4, "shared prefix"), as a mixin of `BlockManager`.

Matching a new sequence's tokens against cached full blocks, mapping the hits by reference at admission, and keying
(committing) the full blocks a forward has written. The index itself (entries, keys, LRU) is
`hf_paged.core.block_pool.CachingBlockAllocator`. Pure Python. (How keys, entries and the evictable pool work:
`hf_paged.core.block_manager`'s docstring.)

* Who keys what: `commit(seq_id, token_ids, num_computed)` keys the full blocks among the first `num_computed`
  tokens. The engine has the scheduler call it for a step's prompt chunks once that step's forward is launched
  (`Scheduler.commit_launched`: the keying overlaps the forward, whose tokens were all known when it was scheduled;
  whatever reads the blocks runs after it on its stream). The scheduler also calls it for every running sequence at
  the start of `schedule()` (what was not keyed yet), before a preemption and when a sequence is freed (finished,
  aborted, failed). In the same window the engine hashes ahead the prompts of the waiting groups that one step's
  budgets could admit next (`Scheduler.prepare_admissions`, `chain_keys`, passed to `match_prefix(...,
  known_keys=...)`). Why: a prefill step is planned while the GPU waits (the step before ended in its tokens' sync),
  and this bookkeeping was most of that planning (H100, 64 prompts of 2-8k tokens: 3.9-8.1 -> 1.8-2.6 ms a step).
  Pipelined decode batches commit the blocks their rows fill by record (`commit_rows`).
* Admission: `match_prefix(token_ids)` (pure) gives a `PrefixMatch`; `blocks_needed_to_admit` counts the cached
  blocks that would leave the evictable pool; `allocate_prefix(seq_id, token_ids, match)` maps the cached blocks by
  reference and returns the cached token count, which the scheduler takes as `num_computed`. At most
  `(len - 1) // block_size` blocks are mapped. If the block after a waiting group's cached prefix is being computed by
  a running sequence (`PrefixMatch.pending`), admission waits one step for it. `SequenceGroup.max_cached_prefix`
  (`match_prefix(..., max_cached_tokens)`) caps the mapped prefix where later positions' logits are wanted (prompt
  log-probabilities).
* Forks share entries (a child commits the same content as the same entry). A recompute-preempted sequence hits its
  own blocks on re-admission if they were not evicted meanwhile.
* Statistics: `BlockStats.cached_blocks / prefix_query_tokens / prefix_hit_tokens / prefix_hit_rate`,
  `prefix_cache_stats()` (`PrefixCacheStats`, evictions too); the engine's `stats["prefix_query_tokens"]`,
  `["prefix_hit_tokens"]` (prefill tokens saved) and `["prefix_hit_rate"]`, and `Engine.prefix_cache_stats()`.
* The drop-in `PagedCache` (transformers' generate loop) builds its `BlockManager` without prefix caching; the
  engine turns it on by default (`Engine(enable_prefix_caching=True)`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from .block_pool import CachingBlockAllocator, _as_int, chain_hashes, hash_block, salted_root
from .block_stats import PrefixCacheStats, PrefixMatch
from .seq_blocks import _Seq

__all__ = ["PrefixCaching"]

_HASH_BLOCK = hash_block  # the module's own; `hash_block` below is looked up per call (tests patch it)


class PrefixCaching:
    """Prefix-cache operations; mixed into `BlockManager` (uses its `_seqs`, `gpu`, `_pending`, counters)."""


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

    def _chain_keys(self, token_ids: Sequence[int], num_blocks: int, known: Sequence[int] = (),
                    salt: int = 0) -> list[int]:
        """The chained keys of the first `num_blocks` full blocks of `token_ids` (`hash_block`'s, in one pass over a
        buffer of the tokens unless a test patched `hash_block`). `known`: the keys of its first blocks, computed
        before from the same tokens and salt (`chain_keys`); only the blocks after them are hashed. `salt`: what
        besides the tokens the K/V depend on (`salted_root`: a LoRA adapter's id), 0 for none."""
        keys = list(known[:num_blocks])
        start = len(keys)
        if start == num_blocks:
            return keys
        shift = self._shift
        key = keys[-1] if keys else salted_root(salt)[0]
        if hash_block is _HASH_BLOCK:
            return keys + chain_hashes(key, token_ids[start << shift :], num_blocks - start, 1 << shift)
        for i in range(start, num_blocks):
            key = hash_block(key, tuple(token_ids[i << shift : (i + 1) << shift]))
            keys.append(key)
        return keys

    def chain_keys(self, token_ids: Sequence[int], salt: int = 0) -> list[int]:
        """The prefix-cache keys of every full block of `token_ids` (none without prefix caching): computed ahead of
        an admission (`Scheduler.prepare_admissions`), they are passed to `match_prefix` as `known_keys`."""
        if not self.enable_prefix_caching:
            return []
        return self._chain_keys(token_ids, len(token_ids) >> self._shift, salt=salt)

    def match_prefix(self, token_ids: Sequence[int], max_cached_tokens: int | None = None, *,
                     known_keys: Sequence[int] = (), salt: int = 0) -> PrefixMatch:
        """The cached whole-block prefix a new sequence with ``token_ids`` would get now; changes nothing.

        Walks the chain of full blocks, stopping at the first block that is not cached with exactly these tokens
        after exactly the prefix matched so far. At most ``(len(token_ids) - 1) // block_size`` blocks are used, so
        at least one token (the last) is left to compute; ``max_cached_tokens`` lowers that bound (whole blocks
        within it), for a sequence that needs the logits of the positions after it. Without prefix caching: an
        empty match. ``known_keys``: the keys of the first blocks of ``token_ids``, from an earlier :meth:`chain_keys`
        of those tokens (a prompt's: its tokens never change); the blocks after them are hashed here. ``salt``: the
        sequence's K/V depend on it too (a LoRA adapter's id, `salted_root`): only blocks of the same salt match.
        """
        n = len(token_ids)
        if not self.enable_prefix_caching or n <= 0:
            return PrefixMatch(num_tokens=n)
        gpu: CachingBlockAllocator = self.gpu  # type: ignore[assignment]
        keys = self._chain_keys(token_ids, n >> self._shift, known_keys, salt)
        usable = (n - 1) >> self._shift
        if max_cached_tokens is not None:
            usable = min(usable, _as_int("max_cached_tokens", max_cached_tokens, 0) >> self._shift)
        blocks: list[int] = []
        entries: list[int] = []
        parent = salted_root(salt)[1]
        shift = self._shift
        for i, key in enumerate(keys):  # up to the first miss: only those blocks' tokens are sliced
            entry = gpu.lookup(key, parent, tuple(token_ids[i << shift : (i + 1) << shift]))
            if entry is None:
                break
            blocks.append(entry.block)
            entries.append(entry.id)
            parent = entry.id
        hits = len(blocks)
        mapped = min(hits, usable)
        pending = hits < usable and keys[hits] in self._pending
        state_key = None
        if self.state is not None:
            # a hybrid model resumes its recurrent layers from a state checkpoint: only a prefix ending at a
            # checkpointed block can be skipped (the blocks after it are computed again, their K/V rewritten)
            while mapped and not self.state.has_checkpoint(entries[mapped - 1]):
                mapped -= 1
            state_key = entries[mapped - 1] if mapped else None
        return PrefixMatch(
            num_tokens=n,
            num_cached_tokens=mapped << self._shift,
            blocks=tuple(blocks[:mapped]),
            entries=tuple(entries[:mapped]),
            keys=tuple(keys),
            num_hit_blocks=hits,
            pending=pending,
            state_key=state_key,
            salt=salt,
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
            if self.state is not None:
                self.state.allocate(seq_id)
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
        if self.state is not None:
            # zeros, or the checkpoint at the mapped prefix's end (raises NoFreeSlotsError before anything changed)
            self.state.allocate(seq_id, match.state_key)
        for block in match.blocks:
            gpu.acquire(block)
        seq = self._seqs[seq_id] = _Seq(list(match.blocks), match.num_cached_tokens)
        self._num_logical += len(match.blocks)
        seq.keys = list(match.keys)
        seq.salt = match.salt
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
        if not self.enable_prefix_caching:
            return 0
        return self._commit_record(seq, token_ids, num_computed)

    def _commit_record(self, seq, token_ids: Sequence[int], num_computed: int) -> int:
        """`commit` of a sequence's record, prefix caching on (nothing while the sequence is swapped out)."""
        if seq.swapped:
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
        register = self.gpu.register
        self._drop_pending(seq.keys[:full], start)
        for i in range(start, full):
            _key_block(register, seq, i, tuple(token_ids[i << shift : (i + 1) << shift]))
        seq.committed = full
        return full - start

    def save_state_checkpoint(self, seq_id: Hashable, token_ids: Sequence[int], position: int) -> bool:
        """Checkpoint a hybrid model's recurrent state of `seq_id` at `position` (a block boundary the last forward
        ended at), keyed by the cache entry of the block ending there, so that a later prompt with the same prefix
        resumes from it (:meth:`match_prefix`). Commits the blocks up to `position` first. Returns whether a
        checkpoint was taken (not without prefix caching or state slots, for a stale sequence, or when every
        checkpoint slot is pinned)."""
        if self.state is None or not self.enable_prefix_caching:
            return False
        p = _as_int("position", position, 1)
        if p & ((1 << self._shift) - 1):
            raise ValueError(f"position must be a multiple of the block size ({1 << self._shift}), got {p}")
        seq = self._get_resident(seq_id, "checkpointing its state")
        self._commit_record(seq, token_ids, p)
        index = (p >> self._shift) - 1
        if index >= len(seq.entries) or seq.entries[index] is None:
            return False
        return self.state.save_checkpoint(seq_id, seq.entries[index])

    def commit_rows(self, records: list, token_lists: list, ends: list[int]) -> None:
        """`commit` for rows of a decode batch (`DecodeBatch.advance`), by their records: each `ends[k]` is a
        multiple of the block size, the end of the block that row k just filled, the only one it has not keyed.
        The same keys and entries as `commit`, without its look-ups and checks (a decode step's rows are running,
        resident sequences of this manager); a row that is not in that state takes `commit` itself."""
        register = self.gpu.register
        shift = self._shift
        for record, token_ids, end in zip(records, token_lists, ends):
            i = (end >> shift) - 1  # the block just filled
            if record.committed != i or len(record.keys) != i or record.swapped or end > record.num_tokens:
                self._commit_record(record, token_ids, end)
                continue
            _key_block(register, record, i, tuple(token_ids[end - (1 << shift) : end]))
            record.committed = i + 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached block's content (the weights that computed it changed); return the entries dropped.

        Evictable cached blocks become plain free blocks. Live sequences keep their blocks (their own K/V stays
        theirs), but are marked stale: what they commit from now on is never offered to other sequences, and the
        keys they were still to compute stop holding back new requests that wait to share them.
        """
        if not self.enable_prefix_caching:
            return 0
        for seq in self._seqs.values():
            seq.stale = True
            del seq.keys[seq.committed:]
        self._pending.clear()
        if self.state is not None:
            self.state.drop_checkpoints()
        return self.gpu.forget_all()

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


def _key_block(register, seq, i: int, chunk: tuple[int, ...]) -> None:
    """Key block `i` of `seq`'s record, whose tokens are `chunk`: its hash (unless computed ahead, see `keys`) and
    the cache entry now describing it, chained to block `i - 1`'s (None when that one has none, or the sequence is
    stale). `hash_block` is looked up here, as a module global, on every call (tests patch it)."""
    keys, entries = seq.keys, seq.entries
    root_key, root_entry = salted_root(seq.salt) if not i else (0, 0)
    if i == len(keys):
        keys.append(hash_block(keys[i - 1] if i else root_key, chunk))
    parent = entries[i - 1] if i else root_entry
    entries.append(None if parent is None or seq.stale else register(seq.table[i], keys[i], parent, chunk))
