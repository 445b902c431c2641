"""The device-side table store of the static decode path: which store row holds which sequence's block table, and
the uploads that keep the rows current (a mixin of `ModelRunner`, which owns the buffers; see its module docstring).

Why a store: every sequence keeps its table in a row of its own across steps, and the graph gathers the step's
`block_tables` from it by row index, so a decode step uploads only what changed. Most steps change a table in its
last entry only (one in `block_size` rows opens a block; a copy-on-write replaces the last one): those entries go as
single points, not as whole rows.

The store is `[2 * max_num_seqs + 1, max_blocks]` (row 0 serves the padding rows). A row is uploaded only when its
table's `(length, last block)` changed since its upload, or its sequence is new. Preemption, swaps and failed steps
invalidate every row (tables were rebuilt or moved); the rows of sequences no longer in the step are swept when the
store runs out of rows. Entries released out of a sliding window keep their stale ids in the store: valid, and never
read.
"""

from __future__ import annotations

import numpy as np

from ..cache import device_table

__all__ = ["TableStore", "kept_rows"]


def kept_rows(batch, number: int, last: tuple) -> np.ndarray | None:
    """The store rows of step `number` of `batch`, taken from those of the step before it when that was the last
    static step (`last`: its sequence ids, by identity, and rows): each row of the step is the row `source` names in
    the step before, from which rows only left (`DecodeBatch.remove`). None when that does not hold."""
    before, step = batch.rows_of(number - 1), batch.rows_of(number)
    if before is None or step is None or last[1] is not before.seq_ids:
        return None
    return last[2][step.source]


class TableStore:
    """Mixed into `ModelRunner` (which provides `cache`, `max_blocks_per_seq`, `_buffers`, `_store_capacity` and
    `table_rows_uploaded`)."""

    def invalidate_tables(self) -> None:
        """Forget which table every store row holds (after preemption, swaps or a failed step): rows re-upload."""
        self._row_of: dict = {}  # seq_id -> [store row, table length, last block] as uploaded
        self._last_rows = None  # (row_of, seq ids, their rows) of the last static step, if no other step ran since
        if self._buffers is not None:
            self._free_rows = list(range(self._store_capacity - 1, 0, -1))  # row 0: the padding rows' row

    def _rows_and_changes(self, seq_ids: list) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """Each sequence's store row (a new one for a new sequence), and the (row, table) pairs to upload: tables
        whose (length, last block) differ from what their row holds."""
        row_of = self._row_of
        rows = []
        changed: list[tuple[int, list[int]]] = []
        live = None
        for seq_id, table in zip(seq_ids, self.cache.block_manager.table_views(seq_ids)):
            entry = row_of.get(seq_id)
            if entry is None:
                if live is None:
                    live = set(seq_ids)
                entry = row_of[seq_id] = [self._take_row(live), -1, -1]
            if entry[1] != len(table) or entry[2] != table[-1]:
                # a table only grows or has its last block replaced between two steps of a running sequence;
                # anything else (preemption, swaps, failed steps) invalidated every row before we got here. Entries
                # released out of the sliding window keep their old id in the store: a valid id no kernel reads
                # (they lie wholly before every query's window), so releasing needs no upload
                entry[1], entry[2] = len(table), table[-1]
                changed.append((entry[0], table))
            rows.append(entry[0])
        return rows, changed

    def _changed_rows(self, seq_ids: list, indices: list[int]
                      ) -> tuple[list[tuple[int, list[int]]], tuple[list[int], list[int]], bool]:
        """The uploads for the sequences at `indices`, whose tables changed in this step's reservation; their rows'
        records are updated. A table that gained one block or had its last block replaced (copy-on-write) since its
        row was uploaded changes in one entry: it goes as a point, `(flat store index, block)`, in two lists, rather
        than as a whole row. Returns the whole rows `(row, table)`, the points, and whether some table outgrew the
        store's rows."""
        row_of = self._row_of
        mb = self.max_blocks_per_seq
        picked = [seq_ids[i] for i in indices]
        changed, flat, blocks = [], [], []
        too_long = False
        for seq_id, table in zip(picked, self.cache.block_manager.table_views(picked)):
            entry = row_of[seq_id]
            n, last = len(table), table[-1]
            if n > mb:
                too_long = True
            elif n - entry[1] in (0, 1):
                flat.append(entry[0] * mb + n - 1)
                blocks.append(last)
            else:
                changed.append((entry[0], table))
            entry[1], entry[2] = n, last
        return changed, (flat, blocks), too_long

    def _take_row(self, live: set) -> int:
        """A free store row; when none is left, rows of sequences not in this step are swept first."""
        if not self._free_rows:
            for seq_id in [s for s in self._row_of if s not in live]:
                self._free_rows.append(self._row_of.pop(seq_id)[0])
        return self._free_rows.pop()

    def _upload_tables(self, host_set: dict, changed: list[tuple[int, list[int]]], flat, blocks) -> None:
        """Copy the whole `changed` rows and the single entries (`flat` store indices, `blocks`) into the store,
        through `host_set`'s pinned staging buffers (asynchronous on CUDA: the set is written again only two steps
        later)."""
        b = self._buffers
        if changed:
            staged = host_set["staging"].numpy()
            for j, (_, table) in enumerate(changed):
                # past the table: stale ids nobody reads (lengths bound the reads); released entries read as block 0
                staged[j, : len(table)] = device_table(table)
            k = len(changed)
            host_set["staging_rows"].numpy()[:k] = [row for row, _ in changed]
            b["staging"][:k].copy_(host_set["staging"][:k], non_blocking=True)
            b["staging_rows"][:k].copy_(host_set["staging_rows"][:k], non_blocking=True)
            b["store"].index_copy_(0, b["staging_rows"][:k], b["staging"][:k])
            self.table_rows_uploaded += k
        if flat:  # tables changed in their last entry: that entry alone
            k = len(flat)
            host_set["point_index"].numpy()[:k] = flat
            host_set["point_block"].numpy()[:k] = blocks
            b["point_index"][:k].copy_(host_set["point_index"][:k], non_blocking=True)
            b["point_block"][:k].copy_(host_set["point_block"][:k], non_blocking=True)
            b["store"].view(-1).index_copy_(0, b["point_index"][:k], b["point_block"][:k])
            self.table_rows_uploaded += k
