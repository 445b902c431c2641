"""Releasing the blocks that fell out of a sliding window, as a mixin of `BlockManager` (pure Python).

When every attention layer of the model slides, no future query reads the keys before the largest window, so their
blocks only cost memory: their table entries become `NULL_BLOCK` (a prefix of the table; positions still index it)
and their references go back to the pool. See `hf_paged.core.block_manager` for how every other operation skips them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from .block_pool import _as_int
from .seq_blocks import NULL_BLOCK

__all__ = ["SlidingWindow"]


class SlidingWindow:
    """Sliding-window release; mixed into `BlockManager` (uses its `_seqs`, `gpu`, `commit`, counters)."""

    def release_before(self, seq_id: Hashable, first_needed: int) -> int:
        """Release the blocks of a resident sequence that lie wholly before token ``first_needed``; return how many.

        Why: with sliding-window attention on every layer, no future query reads keys before its window, so those
        blocks only cost memory (the caller passes the oldest position any future query of any layer attends:
        ``num_computed - largest_window + 1``). Each released entry becomes :data:`NULL_BLOCK` and drops this table's
        reference: a shared block goes back to the pool only with its last holder, a keyed block stays cached
        (evictable). With prefix caching only committed blocks are released (commit first), so a block never loses
        its cache entry before it got one. Blocks already released stay so; the partial last block is never touched.
        """
        seq = self._get_resident(seq_id, "releasing its blocks")
        upto = min(_as_int("first_needed", first_needed, 0) >> self._shift, seq.num_tokens >> self._shift)
        if self.enable_prefix_caching:
            upto = min(upto, seq.committed)
        start = seq.released
        if upto <= start:
            return 0
        table = seq.table
        # newest first: the older blocks enter the prefix cache's LRU pool last, so the root of a cached chain,
        # without which no later block of it can be matched, is evicted last
        self.gpu.decref_many(table[start:upto][::-1])
        table[start:upto] = [NULL_BLOCK] * (upto - start)
        seq.released = upto
        self._num_logical -= upto - start
        self.window_released += upto - start
        return upto - start

    def release_out_of_window(self, seqs: Iterable, window: int) -> int:
        """:meth:`release_before` of every running sequence for a sliding window of ``window`` tokens; return the
        blocks released. The per-step hot path of the scheduler: a sequence with nothing new to release costs a
        dict lookup and a comparison.

        ``seqs``: resident sequences as objects with ``seq_id``, ``num_computed`` and ``token_ids`` (the scheduler's
        `Sequence`). Their oldest future query sits at ``num_computed`` and attends keys down to
        ``num_computed - window + 1``. With prefix caching the blocks are committed first, so they stay cached.
        """
        shift, states = self._shift, self._seqs
        reach = window - 1
        caching = self.enable_prefix_caching
        total = 0
        for seq in seqs:
            first_needed = seq.num_computed - reach
            state = states[seq.seq_id]
            if first_needed >> shift <= state.released:
                continue
            if caching and first_needed >> shift > state.committed:
                self.commit(seq.seq_id, seq.token_ids, seq.num_computed)
            total += self.release_before(seq.seq_id, first_needed)
        return total
