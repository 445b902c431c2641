"""Releasing the blocks that fell out of a sliding window, as a mixin of `BlockManager` (pure Python).

When every attention layer of the model slides, no future query reads the keys before the largest window, so their
blocks only cost memory: their table entries become `NULL_BLOCK` (a prefix of the table; positions still index it)
and their references go back to the pool. See `hf_paged.core.block_manager` for how every other operation skips them.

* Which models (`Engine(release_window_blocks=True)`, the default): those where every attention layer slides
  (Mistral v0.1, Phi-3-mini-4k, Qwen2 with the window on all layers). The window of a layer is what transformers
  passes to the attention function as `sliding_window`; the attention function records it per layer in
  `PagedCache.layer_windows` on eager forwards, and once every layer was seen `PagedCache.sliding_window_bound()`
  gives the largest window W (None when some layer is full), which the engine hands to `Scheduler.release_window`.
  In a mixed stack (Gemma 2/3's local and global layers, Qwen2 with `max_window_layers`) one table releases nothing,
  the global layers reading every block: the engine gives such a stack one table per layer group instead
  (`hf_paged.core.block_groups`, which runs this release on each sliding group's tables with its own window).
* When: at the start of every `schedule()` and `schedule_decode_step()`, before any reservation, so the freed blocks
  serve this very step. A query at position p attends keys in (p - W, p] (`masking_utils`' sliding overlay, the
  kernels' `q - k < W`), and a sequence's oldest future query is at `num_computed`, so the blocks wholly before token
  `num_computed - W + 1` go (`release_out_of_window`: one dict lookup per sequence with nothing new to release, then
  `release_before`). A decoding sequence then holds at most `ceil(W / block_size) + 1` blocks (a prefill chunk holds
  what it writes).
* How: released entries become `NULL_BLOCK` (-1) and stay in the table (always a prefix of it, counted by
  `_Seq.released`), and the table's reference is dropped. A shared block returns to the pool with its last holder;
  with prefix caching a block is committed before it is released, so it stays cached as evictable (released newest
  first: the root of a cached chain is evicted last). Copy-on-write only ever touches the partial last block, which
  is never released.
* Device tables: `device_table` maps null entries to block 0 when a table is uploaded (`PagedCache._make_step`, the
  static path's staging rows): a valid id that is never read (it lies before every query's window). A release alone
  does not re-upload a table-store row: its stale ids are valid and unread as well. A pipelined step in flight may
  still read a just-released block; the step that writes it again runs after it on the same stream.
* Admission and preemption count the free pool, so released blocks make room for more sequences; a recomputed
  sequence prefills again (chunked by the token budget, releasing between chunks). `add_request` still refuses a
  request whose whole length does not fit the pool (a recompute may need it in one chunk).
* Statistics: `BlockStats.released_blocks` (null entries of resident tables now) and `window_released` (released so
  far), through `Engine.kv_stats()`. Tests: `tests/test_window_release.py`.
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
