"""`DropInRows`: the drop-in `PagedCache`'s batch-row operations of transformers' `Cache` API (beam reordering, batch
selection and repetition, crop), as block-table forks and truncations: no tensor is copied.

A mixin of `PagedCache` with no state of its own: it works on the cache's rows (`_rows`, one sequence of the block
manager per batch row), its sequence counter and its recurrent states.
"""

from __future__ import annotations

import torch

__all__ = ["DropInRows"]


class DropInRows:
    """Beam and batch operations of the drop-in cache's rows (see the module docstring)."""

    def _replace_rows(self, sources: list[int]) -> None:
        """New rows = forks of the given old rows (by index); old rows are released. No tensor is copied."""
        if not self._rows:
            return
        bm = self.block_manager
        for index in sources:
            if not 0 <= index < len(self._rows):
                raise ValueError(f"batch index {index} out of range for a cache of {len(self._rows)} sequences")
        if self.states is not None:
            self.states.make_room(len(sources))  # (every fork takes a slot before the old rows give theirs back)
        new_rows = []
        for index in sources:
            seq = self._next_seq_id
            self._next_seq_id += 1
            bm.fork(self._rows[index], seq)
            new_rows.append(seq)
        for seq in self._rows:
            bm.free(seq)
        self._rows = new_rows
        self._step = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues beam `beam_idx[i]`; blocks are shared, a partial last block is copied on write."""
        self._replace_rows([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if isinstance(indices, torch.Tensor):
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            indices = indices.tolist()
        self._replace_rows([int(i) for i in indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._replace_rows([i for i in range(len(self._rows)) for _ in range(int(repeats))])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop trailing tokens: a negative value removes that many, a positive one (legacy) keeps that many."""
        if tokens_to_remove > 0:
            keep = min(tokens_to_remove, self._seen_tokens)
        else:
            keep = max(0, self._seen_tokens + tokens_to_remove)
        if keep == self._seen_tokens:
            return
        if self.block_manager is not None and self.block_manager.state is not None:
            raise ValueError("PagedCache.crop: a hybrid model's recurrent states cannot be rolled back (they keep no "
                             "per-token history), so this cache cannot be cropped (assisted decoding is not available)")
        removed = self._seen_tokens - keep
        for seq in self._rows:
            self.block_manager.truncate(seq, self.block_manager.num_tokens(seq) - removed)
        self._seen_tokens = keep
        self._step = None
