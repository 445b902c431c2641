"""The block state of one sequence inside `BlockManager`: its table, token count, swap flag and prefix-cache keys.

Pure Python; shared by the block manager and its prefix-caching and swapping mixins.
"""

from __future__ import annotations

__all__ = ["_Seq"]


class _Seq:
    """Per-sequence state. ``table`` holds GPU block ids, or CPU block ids while ``swapped``.

    Prefix caching: ``keys`` are the chain keys of the sequence's full blocks known so far (from the tokens given at
    admission, then extended by :meth:`BlockManager.commit`); the first ``committed`` blocks are written and
    ``entries[i]`` is the id of the cache entry describing block ``i``'s content (None after a collision). Keys past
    ``committed`` are *pending*: those blocks are still to be computed. ``stale``: the sequence's K/V was (partly)
    computed by weights that have changed since (`BlockManager.reset_prefix_cache`): its blocks are never offered to
    other sequences.
    """

    __slots__ = ("committed", "entries", "keys", "num_tokens", "stale", "swapped", "table")

    def __init__(self, table: list[int], num_tokens: int) -> None:
        self.table = table
        self.num_tokens = num_tokens
        self.swapped = False
        self.stale = False
        self.keys: list[int] = []
        self.entries: list[int | None] = []
        self.committed = 0
