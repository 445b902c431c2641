"""The static decode path (CUDA graphs, pipelined decoding) of a grouped cache: one table store per layer group.

A grouped cache (`hf_paged.cache.grouped_cache`) gives every layer group its own block tables and slots, so a static
decode step needs, besides group 0's buffers (`ModelRunner`'s, unchanged), each other group's: a table store with
the same rows as group 0's (a sequence's row holds its table of that group), the step's gathered tables and its
slot mapping. Mixed into `ModelRunner`; everything here runs only when `self.grouped`.

* Uploads: a group's table changes exactly when group 0's does (a new block and a copy-on-write of the shared
  partial last block happen in every group at the same token; entries released out of a window keep their stale,
  valid, unread ids, as in `table_store`), so the rows group 0 uploads this step are uploaded in every other
  group: whole, or, in a step of the persistent decode batch, the new last entry of the rows that opened a block as
  single points (`GroupedBlockManager.append_decode_slots` reports no `changed` rows, so a general step uploads the
  rows group 0 uploads whole). Invalidation is group 0's (`invalidate_tables` forgets every row).
* Slots: each group's slot of every row's token, `-1` on a bucket's padding rows (and while a graph is recorded); a
  batch step's come from the batch's lanes.
* The graph records the gathers of every group's tables (`group_steps`), so a replay reads what was uploaded; the
  compiled step's op (`attention.compiled_op`) picks its layer's group step like the eager attention function.
* Ragged steps (`ragged_graphs`: prefill chunks, recorded per token bucket) likewise: each group's slot of every
  token and its tables gathered for the step's virtual sequences by the same store rows.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cache import StepMetadata, device_table, fill_group_slots

__all__ = ["GroupedStatic"]


class GroupedStatic:
    """Mixed into `ModelRunner` (which provides `cache`, `device`, `max_num_seqs`, `max_blocks_per_seq`,
    `_buffers`, `_host_sets`, `_store_capacity` and `table_rows_uploaded`)."""

    def _ensure_group_buffers(self) -> None:
        """The other groups' device buffers and, in each host set, their pinned staging (`_ensure_buffers`)."""
        k = self.cache.block_manager.num_groups - 1
        n, mb, dev = self.max_num_seqs, self.max_blocks_per_seq, self.device
        pin = dev.type == "cuda"
        self._buffers.update({
            "group_slots": torch.full((k, n), -1, dtype=torch.long, device=dev),
            "group_tables": torch.zeros((k, n, mb), dtype=torch.int32, device=dev),
            "group_store": torch.zeros((k, self._store_capacity, mb), dtype=torch.int32, device=dev),
            "group_staging": torch.zeros((n, k, mb), dtype=torch.int32, device=dev),  # [:m] contiguous
            "group_staging_rows": torch.zeros(n, dtype=torch.long, device=dev),
            "group_point_index": torch.zeros(n, dtype=torch.long, device=dev),
            "group_point_block": torch.zeros((k, n), dtype=torch.int32, device=dev),
        })
        for host_set in self._host_sets:
            host_set["group_slots"] = torch.zeros((k, n), dtype=torch.long, pin_memory=pin)
            host_set["group_staging"] = torch.zeros((n, k, mb), dtype=torch.int32, pin_memory=pin)
            host_set["group_staging_rows"] = torch.zeros(n, dtype=torch.long, pin_memory=pin)
            host_set["group_point_index"] = torch.zeros(n, dtype=torch.long, pin_memory=pin)
            host_set["group_point_block"] = torch.zeros((k, n), dtype=torch.int32, pin_memory=pin)

    def _group_inputs(self, host_set: dict, seq_ids: list, positions, slots0, rows, changed: list, flat,
                      real: int, bucket: int, batch=None, fresh: list | None = None) -> None:
        """Upload the other groups' slots of this step and their rows of the sequences whose group-0 row changed
        (`changed` whole rows, `flat` single entries). The slots are those of a `DecodeBatch` step (`batch`, whose
        rows `fresh` opened a block in every group: those go up as single entries too), or those the block
        manager's batched decode append reserved in every group (`decode_group_slots`, when its group-0 slots are
        this step's `slots0`), else read off each row's tables: at 256 rows and two groups that lookup was most of a
        grouped step's extra host time."""
        bm = self.cache.block_manager
        b, mb = self._buffers, self.max_blocks_per_seq
        slots = host_set["group_slots"].numpy()
        stash, bm.decode_group_slots = bm.decode_group_slots, None
        if batch is not None:
            for g, lane in enumerate(batch.group_slots()):
                slots[g, :real] = lane
            slots[:, real:bucket] = -1
            b["group_slots"].copy_(host_set["group_slots"], non_blocking=True)
            whole = {row for row, _ in changed}
            self._upload_group_rows(host_set, seq_ids, rows, whole)
            if fresh:
                self._upload_group_points(host_set, batch, rows, fresh, whole)
            return
        if stash is not None and len(stash[0]) == real and np.array_equal(stash[0], slots0):
            for g in range(1, bm.num_groups):
                slots[g - 1, :real] = stash[1][g - 1]
        else:
            shift, mask = self.block_size.bit_length() - 1, self.block_size - 1
            tables = [bm.group_tables(seq_id) for seq_id in seq_ids]
            for g in range(1, bm.num_groups):  # each row's one token: its slot in the group's table
                slots[g - 1, :real] = [(t[g][p >> shift] << shift) | (p & mask) for t, p in zip(tables, positions)]
        slots[:, real:bucket] = -1
        b["group_slots"].copy_(host_set["group_slots"], non_blocking=True)
        self._upload_group_rows(host_set, seq_ids, rows, {row for row, _ in changed} | {index // mb for index in flat})

    def _upload_group_rows(self, host_set: dict, seq_ids: list, rows, touched: set) -> None:
        """Upload whole the other groups' rows `touched` (the step's row `i` is sequence `seq_ids[i]`, whose store
        row is `rows[i]`)."""
        if not touched:
            return
        bm, b = self.cache.block_manager, self._buffers
        rows = np.asarray(rows, dtype=np.int64)
        at = np.flatnonzero(np.isin(rows, np.fromiter(touched, np.int64, len(touched)))).tolist()
        picked = list(zip(rows[at].tolist(), at))
        staged = host_set["group_staging"].numpy()
        for j, (_, i) in enumerate(picked):
            tables = bm.group_tables(seq_ids[i])
            for g in range(1, bm.num_groups):
                table = tables[g]
                staged[j, g - 1, : len(table)] = device_table(table)
        m = len(picked)
        host_set["group_staging_rows"].numpy()[:m] = [row for row, _ in picked]
        b["group_staging"][:m].copy_(host_set["group_staging"][:m], non_blocking=True)
        b["group_staging_rows"][:m].copy_(host_set["group_staging_rows"][:m], non_blocking=True)
        for g in range(bm.num_groups - 1):
            b["group_store"][g].index_copy_(0, b["group_staging_rows"][:m], b["group_staging"][:m, g])
        self.table_rows_uploaded += m * (bm.num_groups - 1)

    def _upload_group_points(self, host_set: dict, batch, rows, fresh: list, whole: set) -> None:
        """The new last entry of the other groups' tables of a batch step's rows `fresh` (each opened a block in
        every group: one entry per group changed, as in group 0's store rows), except the rows uploaded whole."""
        at = np.asarray(fresh, dtype=np.int64)
        store_rows = np.asarray(rows, dtype=np.int64)[at]
        if whole:
            keep = ~np.isin(store_rows, np.fromiter(whole, np.int64, len(whole)))
            at, store_rows = at[keep], store_rows[keep]
        m = len(at)
        if not m:
            return
        b, mb = self._buffers, self.max_blocks_per_seq
        shift = self.block_size.bit_length() - 1
        host_set["group_point_index"].numpy()[:m] = store_rows * mb + (batch.starts[at] >> shift)
        blocks = host_set["group_point_block"].numpy()
        for g, last in enumerate(batch.group_last_blocks()):
            blocks[g, :m] = last[at]
        b["group_point_index"][:m].copy_(host_set["group_point_index"][:m], non_blocking=True)
        # the whole [groups, rows] buffer (a few KB): a column slice of pinned memory would not copy asynchronously
        b["group_point_block"].copy_(host_set["group_point_block"], non_blocking=True)
        for g in range(len(blocks)):
            b["group_store"][g].view(-1).index_copy_(0, b["group_point_index"][:m], b["group_point_block"][g, :m])
        self.table_rows_uploaded += m * len(blocks)

    # ------------------------------------------------------------------ ragged steps (`ragged_graphs`)
    def _ensure_ragged_groups(self, tokens: int, virtual: int) -> None:
        """The other groups' slots (`tokens`) and gathered tables (`virtual` sequences) of the ragged buffers."""
        k = self.cache.block_manager.num_groups - 1
        pin = self.device.type == "cuda"
        self._ragged["group_slots"] = torch.full((k, tokens), -1, dtype=torch.int32, device=self.device)
        self._ragged["group_tables"] = torch.zeros((k, virtual, self.max_blocks_per_seq), dtype=torch.int32,
                                                   device=self.device)
        for host_set in self._host_sets:
            host_set["ragged_group_slots"] = torch.zeros((k, tokens), dtype=torch.int32, pin_memory=pin)

    def _ragged_group_inputs(self, host_set: dict, scheduled: list, rows, changed: list, bucket: int) -> None:
        """A ragged step's other groups: each token's slot (-1 on padding) and the rows whose tables changed."""
        bm = self.cache.block_manager
        tables = [bm.group_tables(item.seq.seq_id) for item in scheduled]
        slots = host_set["ragged_group_slots"].numpy()
        at = fill_group_slots(slots, scheduled, tables, self.block_size.bit_length() - 1)
        slots[:, at:bucket] = -1
        self._ragged["group_slots"].copy_(host_set["ragged_group_slots"], non_blocking=True)
        self._upload_group_rows(host_set, [item.seq.seq_id for item in scheduled], rows, {row for row, _ in changed})

    def _with_ragged_group_steps(self, step: StepMetadata, virtual: int, bucket: int) -> StepMetadata:
        """A ragged step on the ragged buffers with every other group's (tables gathered for its virtual
        sequences by the same store rows; recorded in a graph)."""
        r, b = self._ragged, self._buffers
        steps = [step]
        for g in range(self.cache.block_manager.num_groups - 1):
            torch.index_select(b["group_store"][g], 0, r["vrows"][:virtual], out=r["group_tables"][g, :virtual])
            steps.append(StepMetadata(
                layout="ragged", slot_mapping=r["group_slots"][g, :bucket], block_tables=r["group_tables"][g, :virtual],
                seq_lens=step.seq_lens, cu_seqlens_q=step.cu_seqlens_q, max_seqlen_q=step.max_seqlen_q,
                decode_only=False))
        step.group_steps = steps
        return step

    def _with_group_steps(self, step: StepMetadata, batch: int) -> StepMetadata:
        """`step` (group 0's, on the static buffers) with every other group's: their tables gathered by the same
        store rows (recorded in a graph), their slots."""
        b = self._buffers
        steps = [step]
        for g in range(self.cache.block_manager.num_groups - 1):
            torch.index_select(b["group_store"][g], 0, b["rows"][:batch], out=b["group_tables"][g, :batch])
            steps.append(StepMetadata(
                layout="ragged", slot_mapping=b["group_slots"][g, :batch], block_tables=b["group_tables"][g, :batch],
                seq_lens=step.seq_lens, cu_seqlens_q=step.cu_seqlens_q, max_seqlen_q=1, decode_only=True,
                split_counters=step.split_counters))
        step.group_steps = steps
        return step
