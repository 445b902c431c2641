"""The block state of one sequence inside `BlockManager`: its table, token count, swap flag and prefix-cache keys.

Pure Python; shared by the block manager and its prefix-caching and swapping mixins.
"""

from __future__ import annotations

__all__ = ["NULL_BLOCK", "_Seq"]

NULL_BLOCK = -1  # a released table entry (out of every layer's sliding window): holds no block


class _Seq:
    """Per-sequence state. ``table`` holds GPU block ids, or CPU block ids while ``swapped``.

    Prefix caching: ``keys`` are the chain keys of the sequence's full blocks known so far (from the tokens given at
    admission, then extended by :meth:`BlockManager.commit`); the first ``committed`` blocks are written and
    ``entries[i]`` is the id of the cache entry describing block ``i``'s content (None after a collision). Keys past
    ``committed`` are *pending*: those blocks are still to be computed. ``stale``: the sequence's K/V was (partly)
    computed by weights that have changed since (`BlockManager.reset_prefix_cache`): its blocks are never offered to
    other sequences. ``salt``: the prefix-cache keys of its blocks chain from `salted_root(salt)`.

    Sliding windows: the first ``released`` entries of ``table`` are :data:`NULL_BLOCK`: blocks no future query of
    any layer attends (`BlockManager.release_before`), given back to the pool. Released entries are always a prefix.
    """

    __slots__ = ("committed", "entries", "keys", "num_tokens", "released", "salt", "stale", "swapped", "table")

    def __init__(self, table: list[int], num_tokens: int) -> None:
        self.table = table
        self.num_tokens = num_tokens
        self.swapped = False
        self.stale = False
        self.keys: list[int] = []
        self.entries: list[int | None] = []
        self.committed = 0
        self.released = 0
        self.salt = 0  # what besides the tokens its K/V depend on (`block_pool.salted_root`; a LoRA adapter's id)

    @property
    def num_held(self) -> int:
        """Table entries that hold a block (the released prefix holds none)."""
        return len(self.table) - self.released

    def held(self) -> list[int]:
        """The blocks this table holds, in order (a copy; the released prefix left out)."""
        return self.table[self.released:]
